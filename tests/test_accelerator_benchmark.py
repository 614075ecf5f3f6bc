"""benchmarks/accelerator.py --json: every row present with measured numbers (toy sizes on CPU)."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, REPO

SCRIPT = os.path.join(REPO, "benchmarks", "accelerator.py")
# LLVM at -O0, as device_env (tests/conftest.py): compiles dominate the toy rows, and this
# test checks the document, not the speed.
ENV = dict(os.environ, PYTHONPATH=REPO,
           XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}")


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def doc():
  proc = subprocess.run([sys.executable, SCRIPT, "--json"], env=ENV, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout)  # stdout is exactly one JSON document


def test_train_rows_have_tokens_per_s_and_mfu(doc):
  train = doc["train"]
  assert _positive(train["peak_flops_per_device"]) and train["peak_source"]
  for name in ("350m", "1b"):
    assert _positive(train[name]["tokens_per_s"])
    assert 0 < train[name]["mfu"] <= 1
    assert _positive(train[name]["num_params"]) and train[name]["loss_finite"]


def test_energy_block_costs_every_training_row(doc):
  energy = doc["energy"]
  assert _positive(energy["price_per_device_hour"])
  for name in ("350m", "1b"):
    row = energy[name]
    assert row["tokens_per_s"] == doc["train"][name]["tokens_per_s"]
    assert _positive(row["usd_per_million_tokens"])
    if doc["env"]["platform"] == "cpu":  # no NVML: power is null, and says why
      assert row["avg_power_w"] is None and row["tokens_per_joule"] is None
      assert row["power_reason"]
    elif row["avg_power_w"] is not None:
      assert _positive(row["tokens_per_joule"])


def test_attention_times_and_memory_per_length(doc):
  att = doc["attention"]
  lengths = [str(t) for t in att["config"]["lengths"]]
  assert len(lengths) == 3
  for impl in ("cudnn", "blockwise"):
    for t in lengths:
      row = att[impl][t]
      if impl == "cudnn" and doc["env"]["platform"] != "gpu":
        assert row["skipped"] and row["reason"]
        continue
      assert _positive(row["time_s"]) and _positive(row["memory_bytes"])


def test_moe_dense_and_dropless(doc):
  moe = doc["moe"]
  for v in ("dense", "dropless"):
    assert _positive(moe[v]["step_time_median_s"]) and _positive(moe[v]["tokens_per_s"])
  assert _positive(moe["ratio_dropless_over_dense"])
  assert moe["dropless"]["active_params"] <= 1.1 * moe["dense"]["active_params"]


def test_decode_speculative_and_quant(doc):
  for b in doc["decode"]["config"]["batches"]:
    assert _positive(doc["decode"][f"batch_{b}"]["tokens_per_s"])
  assert len(doc["decode"]["config"]["batches"]) == 3
  spec = doc["speculative"]
  assert _positive(spec["speedup"]) and _positive(spec["target_alone_tokens_per_s"])
  assert 0 <= spec["acceptance_rate"] <= 1 and spec["equal_output"]
  for fmt in ("bf16", "int8", "int4"):
    assert _positive(doc["quant"][fmt]["tokens_per_s"])
  assert doc["quant"]["int4"]["weight_bytes"] < doc["quant"]["bf16"]["weight_bytes"]
  assert not any(isinstance(r, dict) and "error" in r for r in doc.values())


def test_bad_argument_exits_nonzero_with_a_message():
  proc = subprocess.run([sys.executable, SCRIPT, "--json", "--price_per_device_hour", "-1"],
                        env=ENV, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "--price_per_device_hour must be a finite number >= 0, got -1" in proc.stderr
  assert proc.stdout == ""
