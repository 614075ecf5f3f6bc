"""Failure is the norm: processes really killed, checkpoints really damaged, NaNs injected."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from conftest import REPO, device_env
from train import exit_codes
from train.workdir import load_trained

# Sleeps, timeouts and killed processes: run alone, after the parallel part (README).
pytestmark = pytest.mark.serial

QUICKSTART = os.path.join(REPO, "experiments", "quickstart.py")
STEPS = 12
TINY = [f"--config.steps={STEPS}", "--config.batch_size=4", "--config.seq_len=32",
        "--config.log_every=1", "--config.eval_every=1000", "--config.eval_batches=1",
        "--config.checkpoint_every=3", "--config.keep_checkpoints=2",
        "--config.model.vocab_size=320", "--config.tokenizer.train_vocab_size=320",
        "--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.mlp_dim=64",
        "--config.peak_flops_per_device=1e11", "--config.sample.max_new_tokens=0"]


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "cli.main", "train", "--config", QUICKSTART,
          "--workdir", workdir, *TINY, *extra]


def _env(devices=1):
  return device_env(devices)


def _run(workdir, *extra, devices=1, timeout=300):
  out = subprocess.run(_cmd(workdir, *extra), env=_env(devices), cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
  return out.returncode, out.stdout + out.stderr


def _losses(workdir):
  """Loss per step, the last entry winning (steps redone after a restart are logged again)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for record in map(json.loads, f):
      out[record["step"]] = record["loss"]
  return out


def _params(workdir):
  model, _, step = load_trained(workdir)
  return step, [np.asarray(x) for x in __import__("jax").tree.leaves(nnx.state(model))]


def _wait_for_step(workdir, step, proc, timeout=120, checkpoint=None):
  """Until `step` is logged (and checkpoint `checkpoint` is complete on disk)."""
  deadline = time.time() + timeout
  path = os.path.join(workdir, "metrics.jsonl")
  done = lambda: checkpoint is None or os.path.isdir(
      os.path.join(workdir, "checkpoints", str(checkpoint)))  # renamed into place when complete
  while time.time() < deadline:
    assert proc.poll() is None, "the run ended before it could be interrupted"
    if os.path.exists(path) and max(_losses(workdir), default=0) >= step and done():
      return
    time.sleep(0.05)
  raise TimeoutError(f"step {step} not reached")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  code, out = _run(workdir)
  assert code == 0, out[-3000:]
  return workdir


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_then_restart_is_bit_identical(uninterrupted, tmp_path, seed):
  kill_at = random.Random(seed).randint(4, STEPS - 2)  # after the first checkpoint (step 3)
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(workdir), env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    _wait_for_step(workdir, kill_at, proc, checkpoint=3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == -signal.SIGKILL
  code, out = _run(workdir)
  assert code == 0, out[-3000:]
  assert "starting at step 0/" not in out, "the restart did not resume from a checkpoint"
  assert _losses(workdir) == _losses(uninterrupted)
  step_a, a = _params(uninterrupted)
  step_b, b = _params(workdir)
  assert step_a == step_b == STEPS
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  with open(os.path.join(workdir, "goodput.json")) as f:
    goodput = json.load(f)
  assert goodput["restarts"] == 1 and goodput["seconds"]["recompute"] >= 0


def test_sigterm_checkpoints_the_current_step(tmp_path):
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(workdir, "--config.debug.slow_step_at=5",
                               "--config.debug.slow_step_seconds=3"),
                          env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  try:
    _wait_for_step(workdir, 4, proc)
    time.sleep(1.0)  # inside the slow step 5
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
  finally:
    proc.kill()
  assert proc.returncode == exit_codes.PREEMPTED, out[-3000:]
  assert "preempted by SIGTERM at step 5" in out
  assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                if d.isdigit())[-1] == 5


def test_corrupted_newest_checkpoint_falls_back(uninterrupted, tmp_path):
  workdir = str(tmp_path / "run")
  code, out = _run(workdir, "--config.stop_at_step=9")
  assert code == 0, out[-3000:]
  newest = os.path.join(workdir, "checkpoints", "9", "state")
  victims = [os.path.join(root, f) for root, _, files in os.walk(newest) for f in files
             if f not in ("_CHECKPOINT_METADATA",)]
  biggest = max(victims, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)
  code, out = _run(workdir)
  assert code == 0, out[-3000:]
  assert "checkpoint step 9 unreadable (" in out and "; using step 6" in out
  assert "starting at step 6/" in out, out[-3000:]
  losses = _losses(workdir)
  assert losses[STEPS] == _losses(uninterrupted)[STEPS]


@pytest.fixture(scope="module")
def fsdp8_run(tmp_path_factory):
  """7 steps on 8 devices with FSDP=8, uninterrupted: the reference for elastic restores."""
  workdir = str(tmp_path_factory.mktemp("fsdp8"))
  code, out = _run(workdir, *ELASTIC, devices=8)
  assert code == 0, out[-3000:]
  return workdir


ELASTIC = ["--config.steps=7", "--config.batch_size=8", "--config.sharding=fsdp",
           "--config.mesh.fsdp=8", "--config.mesh.data=1"]


@pytest.mark.parametrize("devices, mesh", [(4, ["--config.mesh.data=2", "--config.mesh.tensor=2"]),
                                           (1, [])])
def test_elastic_restore_onto_another_mesh(fsdp8_run, tmp_path, devices, mesh):
  """Saved at step 6 on 8 devices (FSDP=8); step 7 on 4 (data 2 x tensor 2) or 1 device."""
  workdir = str(tmp_path / "run")
  code, out = _run(workdir, *ELASTIC, "--config.stop_at_step=6", devices=8)
  assert code == 0, out[-3000:]
  layout = ["--config.sharding=fsdp+tensor", "--config.mesh.fsdp=1", *mesh]
  code, out = _run(workdir, *ELASTIC, *layout, devices=devices)
  assert code == 0, out[-3000:]
  assert "starting at step 6/7" in out and f"{devices} device(s)" in out
  np.testing.assert_allclose(_losses(workdir)[7], _losses(fsdp8_run)[7], rtol=1e-6)


def test_nan_gradient_is_skipped(tmp_path):
  workdir = str(tmp_path / "run")
  code, out = _run(workdir, "--config.debug.nan_at_step=5")
  assert code == 0, out[-3000:]
  with open(os.path.join(workdir, "anomalies.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [5]
  assert records[0]["action"] == "update skipped" and "non-finite" in records[0]["reason"]
  assert all(np.isfinite(v) for v in _losses(workdir).values())
  assert "1 anomalies" in out


def test_nan_gradient_rolls_back_and_skips_the_data_window(uninterrupted, tmp_path):
  workdir = str(tmp_path / "run")
  code, out = _run(workdir, "--config.debug.nan_at_step=5", "--config.anomaly.policy=rollback")
  assert code == 0, out[-3000:]
  with open(os.path.join(workdir, "anomalies.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert len(records) == 1 and records[0]["step"] == 5
  assert records[0]["action"] == "rolled back to step 3; skipped the data of steps 4-5"
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  reference = _losses(uninterrupted)
  assert all(losses[s] == reference[s] for s in (1, 2, 3))
  assert losses[4] != reference[4]  # step 4 now trains on what was step 6's data


def test_watchdog_trips_on_a_hung_step(tmp_path):
  workdir = str(tmp_path / "run")
  code, out = _run(workdir, "--config.debug.slow_step_at=8", "--config.debug.slow_step_seconds=60",
                   "--config.watchdog.factor=5", "--config.watchdog.min_seconds=3", timeout=120)
  assert code == exit_codes.HUNG, out[-3000:]
  with open(os.path.join(workdir, "watchdog_0.log")) as f:
    log = f.read()
  assert "step 7" in log or "step 8" in log, log[:2000]
  assert "train/loop.py" in log  # the main thread's stack, stopped in the slow step
