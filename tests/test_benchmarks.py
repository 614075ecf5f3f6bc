"""Smoke test for benchmarks/train_throughput.py: it runs and emits the JSON it promises."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "train_throughput.py")
TINY = ["--layers", "1", "--d-model", "32", "--heads", "4", "--kv-heads", "2", "--mlp", "64",
        "--vocab", "128", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--peak-flops", "1e11"]  # a fixed peak skips the CPU matmul measurement


def test_train_throughput_emits_json():
  proc = subprocess.run([sys.executable, SCRIPT, "--json", *TINY], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
  for key in ("config", "steps", "warmup", "env", "meshlm", "transformers", "ratio",
              "ratio_median_step", "ratio_cpu_time", "target_ratio", "target_met"):
    assert key in result
  assert result["steps"] == 2 and result["config"]["d_model"] == 32
  for key in ("jax", "flax", "device_kind", "cpu_count"):
    assert key in result["env"]
  mesh = result["meshlm"]
  for key in ("tokens_per_s", "step_time_median_s", "step_time_mean_s", "mfu", "peak_flops",
              "peak_source", "loss_first", "loss_last"):
    assert key in mesh
  assert mesh["tokens_per_s"] > 0 and mesh["loss_finite"]
  hf = result["transformers"]
  if hf["skipped"]:  # torch/transformers missing: the reason is reported instead
    assert hf["reason"] and result["ratio"] is None
  else:
    assert hf["tokens_per_s"] > 0 and hf["loss_finite"] and hf["threads"] >= 1
    assert result["ratio"] > 0 and isinstance(result["target_met"], bool)
    assert hf["num_params"] == mesh["num_params"]  # the two models have the same shape
