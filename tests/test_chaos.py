"""Failure is the norm: checkpoint overhead benchmark, chaos soak restart loop, Young/Daly planning."""

import json
import math
import os
import random
import subprocess
import sys

import pytest

from conftest import REPO
from benchmarks import chaos
from experiments import chaos as chaos_config, llama3_8b_pod
from train.plan import report as plan_report
from train.plan.cost import DAY_SECONDS, checkpoint_waste, young_daly_interval

# Sleeps, timeouts and killed processes: run alone, after the parallel part (README).
pytestmark = pytest.mark.serial

TINY_MODEL = ["--config.batch_size=4", "--config.seq_len=32", "--config.model.vocab_size=320",
              "--config.tokenizer.train_vocab_size=320", "--config.model.d_model=32",
              "--config.model.num_layers=2", "--config.model.mlp_dim=64"]


def test_checkpoint_benchmark_emits_json():
  tiny = ["--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--mlp", "64",
          "--vocab", "128", "--seq", "16", "--batch", "2", "--every", "2", "--periods", "1"]
  proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "checkpoint.py"),
                         "--json", *tiny], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout)  # the JSON document and nothing else
  for key in ("config", "checkpoint_every", "state_bytes", "param_bytes", "env", "modes",
              "target_overhead", "target_met", "sync_over_async_overhead"):
    assert key in result
  assert result["checkpoint_every"] == 2 and isinstance(result["target_met"], bool)
  assert result["state_bytes"] > 2 * result["param_bytes"]  # parameters and two AdamW moments
  for mode in ("async", "sync"):
    m = result["modes"][mode]
    for key in ("step_time_no_checkpoint_mean_s", "step_time_no_checkpoint_median_s",
                "step_time_with_checkpoint_mean_s", "overhead_fraction", "save_blocking_mean_s",
                "blocking_overhead_fraction", "step_time_after_save_by_position_s"):
      assert key in m, key
    assert m["saves"] == 1 and m["save_blocking_mean_s"] > 0
    assert len(m["step_time_after_save_by_position_s"]) == 2


def test_young_daly_interval():
  assert young_daly_interval(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600))
  # It minimises the first-order waste C/τ + τ/2M.
  best = young_daly_interval(5.0, 1000.0)
  assert checkpoint_waste(best, 5.0, 1000.0) < min(checkpoint_waste(best * f, 5.0, 1000.0)
                                                   for f in (0.8, 1.25))
  for bad in ((0.0, 1.0), (1.0, -1.0)):
    with pytest.raises(ValueError):
      young_daly_interval(*bad)


def test_plan_recommends_a_checkpoint_interval():
  config = llama3_8b_pod.get_config()
  result = plan_report.plan(config, 64, do_suggest=False,
                         checkpointing=dict(failures_per_device_day=1e-4, write_gbps_per_host=1.0,
                                            devices_per_host=8, step_seconds=5.0))
  c = result["checkpointing"]
  assert c["mtbf_seconds"] == pytest.approx(DAY_SECONDS / (1e-4 * 64))
  mem = result["estimate"]["memory"]
  assert c["checkpoint_seconds"] == pytest.approx((mem["params"] + mem["optimizer"]) * 8 / 1e9)
  assert c["interval_seconds"] == pytest.approx(
      young_daly_interval(c["checkpoint_seconds"], c["mtbf_seconds"]))
  assert c["interval_steps"] == round(c["interval_seconds"] / 5.0) and c["step_source"] == "given"
  text = plan_report.format_plan(result)
  assert "checkpoint interval (Young/Daly)" in text and "recommended: every" in text
  # 1e-4 failures per device-day is about 10 a day at 100,000 devices.
  assert DAY_SECONDS / (1e-4 * 100_000) == pytest.approx(DAY_SECONDS / 10)


def test_expected_goodput_peaks_near_young_daly():
  cost, mtbf = 0.5, 2000.0
  taus = [1.02 ** k for k in range(600)]
  best = max(taus, key=lambda t: chaos.expected_goodput(t, cost, 0.0, mtbf))
  assert best == pytest.approx(young_daly_interval(cost, mtbf), rel=0.05)
  assert chaos.expected_goodput(1e9, cost, 0.0, mtbf) == 0.0  # no overflow for huge intervals


def test_torn_metrics_line_is_skipped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo{"step": 2, "loss": 1.5}\n')
  assert chaos.read_records(str(path)) == [{"step": 1, "loss": 2.0}]


def _loop_config(**kw):
  c = chaos_config.get_config().chaos
  c.update(dict(dict(mtbf_seconds=0.3, max_restarts=5), **kw))
  return c


def test_restart_loop_kills_and_restarts(tmp_path):
  """A stand-in job that hangs on its first start (so it is killed) and succeeds on the next."""
  marker = tmp_path / "started"
  script = (f"import os, sys, time\nif os.path.exists({str(marker)!r}): sys.exit(0)\n"
            f"open({str(marker)!r}, 'w').close()\ntime.sleep(60)\n")
  run = chaos.run_with_failures([sys.executable, "-c", script], str(tmp_path / "w"),
                                _loop_config(max_kills=1), dict(os.environ), random.Random(0))
  assert run["completed"] and run["starts"] == 2 and run["kills"] == 1
  assert run["exits"] == [-9, 0]


def test_restart_loop_stops_on_a_non_restartable_exit(tmp_path):
  with pytest.raises(RuntimeError, match="exited 1, not restartable"):
    chaos.run_with_failures([sys.executable, "-c", "import sys; sys.exit(1)"],
                            str(tmp_path / "w"), _loop_config(mtbf_seconds=60.0),
                            dict(os.environ), random.Random(0))


def test_chaos_soak_tiny(tmp_path):
  """The whole soak on a tiny model: one interval, one SIGKILL, then a run to the end (~20 s)."""
  workdir = str(tmp_path / "soak")
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "chaos.py"), "--workdir", workdir,
       "--config.steps=12", *TINY_MODEL, "--config.chaos.checkpoint_intervals=3,",
       # Seed 0's first draw is 1.86 x MTBF: a kill 3 s after the launch, during start-up.
       "--config.chaos.mtbf_seconds=1.6", "--config.chaos.max_kills=1"],
      cwd=REPO, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  with open(os.path.join(workdir, "chaos.json")) as f:
    result = json.load(f)
  (run,) = result["runs"]
  assert run["completed"] and run["kills"] == 1 and run["exits"] == [-9, 0]
  assert 0 < run["goodput"] < 1 and run["step_seconds"] > 0
  summary = result["summary"]
  assert summary["young_daly_seconds"] == pytest.approx(
      young_daly_interval(summary["checkpoint_seconds"], 1.6))
  assert os.path.exists(result["plot"]) and "Young/Daly" in proc.stdout
  with open(os.path.join(workdir, "every_3", "goodput.json")) as f:
    assert json.load(f)["furthest_step"] == 12


def test_checkpoint_cost_benchmark_emits_json():
  proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "checkpoint_cost.py"),
                         "--json", "--rounds", "2", "--d-model", "32", "--layers", "1",
                         "--vocab", "128", "--mlp", "64", "--heads", "2", "--kv-heads", "1"],
                        capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout)
  kinds = {"orbax", "tensorstore", "file", "host_copy"}
  assert result["rounds_counted"] == 1 and result["arrays"] > 0 and result["state_bytes"] > 0
  for key in ("cpu_s_median", "cpu_s_min", "wall_s_median", "cpu_over_file"):
    assert set(result[key]) == kinds
  assert all(v > 0 for v in result["wall_s_median"].values())
