"""Failure handling in the loop: preemption signals, loss anomalies and goodput accounting.

The hang watchdog and the peer-loss monitor run in threads: see train/watchdog.py.
Exit statuses are in train/exit_codes.py; docs/fault_tolerance.md lists every
failure mode and what happens.
"""

import collections
import json
import math
import os
import signal
import statistics
import time

import jax
import numpy as np


class Preempted(Exception):
  """Raised by the loop after it has checkpointed the current step on SIGTERM/SIGINT."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}; "
                     "checkpoint written, run the same command to resume")
    self.step, self.signum = step, signum


class PreemptionGuard:
  """Turns SIGTERM/SIGINT into a flag the loop polls once per step."""

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum

  def requested(self) -> bool:
    """True on every process if any process got a signal (agreed through a collective)."""
    flag = self.signum is not None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      flags = multihost_utils.process_allgather(np.asarray([int(flag)]))
      if flags.any() and self.signum is None:
        self.signum = signal.SIGTERM
      return bool(flags.any())
    return flag

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False


class AnomalyDetector:
  """Flags non-finite losses/gradients and loss spikes (z-score over a sliding window)."""

  def __init__(self, window: int, zscore: float):
    self.window, self.zscore = window, zscore
    self.history = collections.deque(maxlen=window)

  def check(self, loss: float, grad_norm: float) -> str | None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      return "non-finite loss or gradient"
    reason = None
    if self.zscore > 0 and len(self.history) >= max(10, self.window // 2):
      mean = statistics.fmean(self.history)
      std = statistics.pstdev(self.history) or 1e-12
      z = (loss - mean) / std
      if z > self.zscore:
        reason = f"loss spike: {loss:.4g} is {z:.1f} standard deviations above the mean {mean:.4g}"
    if reason is None:
      self.history.append(loss)
    return reason

  def reset(self):
    self.history.clear()


class AnomalyLog:
  """WORKDIR/anomalies.jsonl: one record per anomaly, with its step and data position."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "anomalies.jsonl")
    self.count = 0

  def write(self, step: int, reason: str, action: str, data_state) -> None:
    self.count += 1
    if jax.process_index() != 0:
      return
    record = {"step": step, "reason": reason, "action": action, "data_position": data_state,
              "time": time.time()}
    with open(self.path, "a") as f:
      f.write(json.dumps(record, default=str) + "\n")
    print(f"meshlm: anomaly at step {step}: {reason}; {action}", flush=True)


class Goodput:
  """Wall time split into productive training and each kind of loss, kept across restarts.

  Categories: train (steps that count), compile (first step of each start),
  checkpoint (time the loop blocks on saves), restore, eval, recompute (steps
  redone after a restart because they came after the last checkpoint) and
  anomaly (rollbacks and skipped steps).
  """

  KINDS = ("train", "compile", "checkpoint", "restore", "eval", "recompute", "anomaly", "startup")

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "goodput.json")
    self.seconds = dict.fromkeys(self.KINDS, 0.0)
    self.furthest_step = 0  # the highest step any earlier start of this run reached
    self.restarts = 0
    if os.path.exists(self.path):
      with open(self.path) as f:
        saved = json.load(f)
      self.seconds.update(saved.get("seconds", {}))
      self.furthest_step = saved.get("furthest_step", 0)
      self.restarts = saved.get("restarts", 0) + 1

  def add(self, kind: str, seconds: float) -> None:
    self.seconds[kind] += seconds

  def step_done(self, step: int, seconds: float) -> None:
    self.add("recompute" if step <= self.furthest_step else "train", seconds)
    self.furthest_step = max(self.furthest_step, step)

  def summary(self) -> dict:
    total = sum(self.seconds.values())
    return {"goodput": self.seconds["train"] / total if total else 0.0,
            "total_seconds": total, "restarts": self.restarts,
            "seconds": dict(self.seconds)}

  def save(self) -> None:
    if jax.process_index() != 0:
      return
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({**self.summary(), "furthest_step": self.furthest_step}, f, indent=1)
    os.replace(tmp, self.path)
