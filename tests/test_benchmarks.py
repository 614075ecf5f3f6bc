"""Smoke tests for benchmarks/: each runs at tiny sizes and emits the JSON it promises."""

import json
import os
import subprocess
import sys

import deps
import pytest

from benchmarks import vs_maxtext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "train_throughput.py")
TINY = ["--layers", "1", "--d-model", "32", "--heads", "4", "--kv-heads", "2", "--mlp", "64",
        "--vocab", "128", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--rounds", "3",  # more rounds than steps: one step per round
        "--peak-flops", "1e11"]  # a fixed peak skips the CPU matmul measurement


def test_train_throughput_emits_json():
  for module in ("torch", "transformers"):  # the baseline
    deps.require(module)
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
              "peak_source", "loss_first", "loss_last", "step_scratch_bytes", "xent"):
    assert key in mesh
  assert mesh["tokens_per_s"] > 0 and mesh["loss_finite"] and mesh["step_scratch_bytes"] > 0
  hf = result["transformers"]
  assert not hf["skipped"], hf["reason"]  # torch is installed (above): a bug
  assert hf["tokens_per_s"] > 0 and hf["loss_finite"] and hf["threads"] >= 1
  assert result["ratio"] > 0 and isinstance(result["target_met"], bool)
  # The two timed steps split into two rounds, meshlm and torch taking turns.
  assert result["rounds"] == 2 and len(result["ratio_per_round"]) == 2
  assert hf["num_params"] == mesh["num_params"]  # the two models have the same shape


MOE_SCRIPT = os.path.join(REPO, "benchmarks", "moe.py")
MOE_TINY = ["--layers", "1", "--d_model", "32", "--heads", "4", "--kv_heads", "2",
            "--vocab", "128", "--seq_len", "16", "--batch", "2", "--experts", "4", "--top_k", "2",
            "--expert_mlp", "16", "--steps", "2", "--warmup", "1"]


def test_moe_benchmark_emits_json():
  proc = subprocess.run([sys.executable, MOE_SCRIPT, "--json", *MOE_TINY], cwd=REPO,
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
  for key in ("config", "steps", "warmup", "env", "variants", "ratio_dropless_over_dense",
              "ratio_dropless_ragged_dot_over_dense", "ratio_capacity_over_dense", "target",
              "target_ratio", "target_met", "dense_mlp_flops_share"):
    assert key in result
  assert result["steps"] == 2 and result["config"]["d_model"] == 32
  assert result["config"]["dense_mlp"] == 2 * 16
  for key in ("jax", "backend", "cpu_count"):
    assert key in result["env"]
  variants = result["variants"]
  assert set(variants) == {"dense", "dropless", "dropless_ragged_dot", "capacity"}
  for v in variants.values():
    assert v["step_time_min_s"] > 0 and v["step_time_median_s"] >= v["step_time_min_s"]
    assert v["tokens_per_s"] > 0 and v["loss_finite"]
  dense = variants["dense"]
  assert dense["active_params"] == dense["num_params"]
  router = 1 * 32 * 4  # layers * d_model * experts: the only extra active weights
  for name in ("dropless", "dropless_ragged_dot", "capacity"):
    moe = variants[name]
    assert moe["active_params"] == dense["active_params"] + router  # equal active params
    assert moe["num_params"] > moe["active_params"]
  assert variants["dropless"]["drop_rate"] == 0.0  # dropless drops nothing
  assert 0.0 <= variants["capacity"]["drop_rate"] < 1.0
  # Same init and batches: the two dropless kernels compute the same losses.
  drop, ragged = variants["dropless"], variants["dropless_ragged_dot"]
  assert abs(drop["loss_last"] - ragged["loss_last"]) < 1e-4
  for key in ("ratio_dropless_over_dense", "ratio_capacity_over_dense"):
    assert result[key] > 0
  assert isinstance(result["target_met"], bool)


def test_vs_maxtext_reads_train_compiles_output():
  """benchmarks/vs_maxtext.py's parser on the two lines MaxText's train_compile prints (values
  from its llama3-8b compile for v5p-128); MaxText itself is installed by the benchmark only."""
  out = ("Finished train_compile.py successfully!\n"
         "Cost analysis: {'utilization0{}': 3.0, 'optimal_seconds': 0.111, "
         "'flops': 39189705916416.0, 'bytes accessed': 45669109760.0}\n"
         "Memory analysis: CompiledMemoryStats(generated_code_size_in_bytes=49584640, "
         "argument_size_in_bytes=1509519360, output_size_in_bytes=1508837120, "
         "alias_size_in_bytes=1508831232, temp_size_in_bytes=8281522176, "
         "host_temp_size_in_bytes=0)\n")
  got = vs_maxtext.parse_train_compile(out)
  assert got["peak"] == 1509519360 + 1508837120 - 1508831232 + 8281522176
  assert got["cost"] == {"flops": 39189705916416.0, "bytes_accessed": 45669109760.0,
                         "optimal_seconds": 0.111}
  with pytest.raises(ValueError, match="no memory or cost analysis"):
    vs_maxtext.parse_train_compile("Finished train_compile.py successfully!\n")
