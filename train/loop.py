"""The pretraining loop: steps, evaluation, checkpoints, and what to do when things fail.

Started again with the same config and workdir, a run resumes from the newest
readable checkpoint: parameters, optimizer, step, RNG and the data iterator's
position, so the losses after a restart are bit-identical to an uninterrupted
run's. See docs/fault_tolerance.md for every failure mode.

train() reads as its phases, in order; each is a method of _Run, one invocation's state.
What is trained (data, optimizer, state, step) is the Task's (train/task.py); an
evaluation gate, if any, is a hook the caller passes in (train/gate.py).
"""

import contextlib
import os
import time

import jax
from ml_collections import ConfigDict

import parallel
from models import ConfigError, param_count
from train import flops as flops_lib
from train.checkpoint import Checkpointer, committed_steps
from train.fault import AnomalyDetector, AnomalyLog, Goodput, Preempted, PreemptionGuard
from train.gate import EvalGate, gate_configured
from train.metrics import MetricsWriter
from train.setup import plan_run
from train.task import LMTask, first, to_global
from train.task import batch_sharding as make_batch_sharding
from train.watchdog import Watchdog
from train.workdir import save_metadata


def train(config: ConfigDict, workdir: str, stop_at: int | None = None, task=None,
          gate: EvalGate | None = None) -> dict:
  """Runs (or resumes) training of `task` (default: LMTask, pretraining); returns the last
  logged metrics.

  `stop_at` ends this invocation early, after checkpointing that step, as a
  preemption would; the schedule still spans `config.steps`. `gate` evaluates (and may
  promote) checkpoints as they are written: see train/gate.py. Raises Preempted (after
  checkpointing) on SIGTERM/SIGINT.
  """
  task = LMTask(config) if task is None else task
  check_gate(config, task, gate)  # before anything is written
  run = _Run(config, os.path.abspath(workdir), task)  # plan, data, optimizer, state
  try:
    run.resume()
  except BaseException:
    run.ckpt.close()  # Orbax's background threads, or exiting prints their asyncio errors
    raise
  if run.start == config.steps:
    run.ckpt.close()
    if jax.process_index() == 0:
      print(f"meshlm: already at step {run.start} of config.steps={config.steps}: nothing to do",
            flush=True)
    return {}
  run.start_gate(gate)
  run.begin(stop_at)
  try:
    with run.running() as preemption:
      run.evaluate_at_start()
      while run.step < run.end:
        run.stop_if_preempted(preemption)
        metrics, seconds = run.take_step()
        if run.rolled_back(metrics, seconds):
          continue
        run.log(metrics)
        run.checkpoint_and_gate()
    run.finish()
  finally:
    run.close()
  return run.report()


def check_gate(config: ConfigDict, task, gate: EvalGate | None) -> None:
  """Refuses a gate that cannot run on `task`, and a gated config given no gate."""
  if gate is not None:
    gate.validate(task)
  elif gate_configured(config):
    raise ValueError(f"eval_gate.every={config.eval_gate.every} but train() was given no "
                     "gate: pass gate=align.evals.promote.make_gate(config)")


class _Run:
  """One invocation of train(): its state, and the phases train() calls in order."""

  def __init__(self, config: ConfigDict, workdir: str, task):
    """Setup: the plan, the data, the task's optimizer and state, the checkpointer."""
    self.config, self.workdir, self.task = config, workdir, task
    datasets = {}  # loaded (and a task's data checked) before the workdir is written to
    self.plan = plan_run(config, workdir, before_write=lambda p: datasets.update(task.datasets(p)))
    self.mesh, self.layout = self.plan.mesh, self.plan.layout
    self.goodput = Goodput(workdir)
    started = time.perf_counter()
    self.train_iter, self.validation = iter(datasets["train"]), datasets["validation"]

    self.tx, self.schedule = task.make_optimizer(config)
    with parallel.axis_rules(self.layout.rules):
      self.state, self.shardings, self.frozen, self.frozen_shardings = task.init_state(
          self.plan, self.tx, self.mesh, self.layout)
    self.batch_sharding = make_batch_sharding(self.mesh)
    self.step_fn = self.make_step()

    self.ckpt = Checkpointer(workdir, config.keep_checkpoints, config.async_checkpoints,
                             config.keep_checkpoint_every, config.checkpoint_compression,
                             config.get("checkpoint_idle_writer", False))
    self.goodput.add("startup", time.perf_counter() - started)

  def make_step(self, nan: bool = False):
    return self.task.step_fn(self.tx, self.schedule, self.shardings, self.frozen_shardings,
                             self.batch_sharding, inject_nan=nan)

  def resume(self) -> None:
    """The newest readable checkpoint's state and data position, if there is one."""
    if committed_steps(self.ckpt.directory):
      t = time.perf_counter()
      self.state, _ = self.ckpt.restore(self.state, self.train_iter)
      self.goodput.add("restore", time.perf_counter() - t)
    self.start = self.step = int(self.state["step"])
    self.config_json = self.config.to_dict()
    if self.start > self.config.steps:
      raise ConfigError(f"config.steps={self.config.steps} is below step {self.start}, where "
                        f"this run's newest checkpoint is ({self.workdir}): a run cannot go "
                        "back; pass a larger config.steps or a new --workdir")
    if self.plan.resuming and self.start < self.config.steps:
      # Only now: a restore that failed has left the run's own config in place.
      save_metadata(self.workdir, self.plan.model_cfg, self.plan.tokenizer)

  def start_gate(self, gate: EvalGate | None) -> None:
    """The gate started from the starting model (which it may evaluate as its baseline)."""
    self.gate_run = None
    if gate is not None:
      t = time.perf_counter()
      with parallel.axis_rules(self.layout.rules), jax.set_mesh(self.mesh):
        self.gate_run = gate.start(self.workdir, self.plan,
                                   self.task.eval_model(self.state, self.frozen), self.start)
      self.goodput.add("eval", time.perf_counter() - t)

  def begin(self, stop_at: int | None) -> None:
    """Metrics, anomaly log, watchdog and the step this invocation stops at."""
    c, plan = self.config, self.plan
    self.flops_per_token = flops_lib.train_flops_per_token(plan.model_cfg, c.seq_len)
    self.peak, peak_source = flops_lib.peak_flops_per_device(plan.model_cfg.jnp_dtype,
                                                             c.peak_flops_per_device)
    self.writer = MetricsWriter(self.workdir, c.steps, self.start)
    self.anomalies = AnomalyLog(self.workdir)
    self.detector = AnomalyDetector(c.anomaly.window, c.anomaly.zscore)
    if jax.process_index() == 0:
      print(f"meshlm: {param_count(plan.model_cfg):,} params, "
            f"{jax.device_count()} device(s) in {jax.process_count()} process(es), "
            f"mesh {dict(self.mesh.shape)}, MFU peak {self.peak / 1e9:.1f} GFLOP/s per device "
            f"({peak_source}); starting at step {self.start}/{c.steps}", flush=True)
    self.watchdog = Watchdog(c.watchdog.factor, c.watchdog.min_seconds,
                             os.path.join(self.workdir, f"watchdog_{jax.process_index()}.log"))
    self.last, self.rollbacks, self.compiled = {}, 0, False
    self.window_start, self.window_tokens = time.perf_counter(), 0.0
    stop_at = stop_at or c.stop_at_step or None
    self.end = c.steps if stop_at is None else min(stop_at, c.steps)

  @contextlib.contextmanager
  def running(self):
    """The steps' context: sharding rules, mesh, pipeline schedule, preemption signals."""
    with (parallel.axis_rules(self.layout.rules), jax.set_mesh(self.mesh),
          parallel.pipeline_schedule(self.plan.pipeline), PreemptionGuard() as preemption):
      yield preemption

  def validation_metrics(self) -> dict:
    t = time.perf_counter()
    out = self.task.evaluate(self.state["params"], self.frozen,
                             first(self.validation, self.config.eval_batches),
                             self.batch_sharding)
    self.goodput.add("eval", time.perf_counter() - t)
    return out

  def evaluate_at_start(self) -> None:
    if self.step == 0 and self.config.eval_at_start:  # the starting model's baseline
      self.writer.write(0, self.validation_metrics())

  def save(self, force: bool = True) -> None:
    t = time.perf_counter()
    self.ckpt.save(self.step, self.state, self.train_iter, self.config_json, force=force)
    self.goodput.add("checkpoint", time.perf_counter() - t)

  def stop_if_preempted(self, preemption) -> None:
    """On SIGTERM/SIGINT: checkpoint this step (if not yet) and raise Preempted."""
    if preemption.requested():
      if self.ckpt.latest_step() != self.step:
        self.save()
      self.ckpt.wait()
      raise Preempted(self.step, preemption.signum)

  def take_step(self) -> tuple[dict, float]:
    """One training step: (its metrics as floats, its seconds)."""
    c, step = self.config, self.step
    self.watchdog.step_started(step)
    t = time.perf_counter()
    batch = next(self.train_iter)
    if hasattr(self.task, "prepare"):  # on-policy tasks (PPO, GRPO) roll out here
      batch = self.task.prepare(self.state, self.frozen, batch, step)
    batch = to_global(batch, self.batch_sharding)
    inject = step + 1 == c.debug.nan_at_step and not self.rollbacks  # once, not on replay
    fn = self.make_step(nan=True) if inject else self.step_fn
    self.state, metrics = fn(self.state, batch, self.frozen)
    if step + 1 == c.debug.slow_step_at:
      time.sleep(c.debug.slow_step_seconds)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    seconds = time.perf_counter() - t
    self.watchdog.step_finished(step, seconds)
    self.step += 1
    if not self.compiled:  # the first step of each start pays for compilation
      self.goodput.add("compile", seconds)
      self.compiled, self.window_start = True, time.perf_counter()
    else:
      self.goodput.step_done(self.step, seconds)
      self.window_tokens += self.task.tokens_per_step
    self.writer.advance()
    return metrics, seconds

  def rolled_back(self, metrics: dict, seconds: float) -> bool:
    """Logs an anomalous step; under policy 'rollback' (while rollbacks remain) restores the
    last checkpoint past the data that led here and returns True."""
    c, step = self.config, self.step
    reason = self.detector.check(metrics["loss"], metrics["grad_norm"])
    if not reason:
      return False
    data_position = self.train_iter.get_state()
    back = self.ckpt.latest_step()
    if (c.anomaly.policy == "rollback" and back is not None
        and self.rollbacks < c.anomaly.max_rollbacks):
      self.ckpt.wait()
      t = time.perf_counter()
      self.state, back = self.ckpt.restore(self.state, self.train_iter)
      for _ in range(step - back):  # skip the data window that led here
        next(self.train_iter)
      self.anomalies.write(step, reason, f"rolled back to step {back}; skipped the data of "
                           f"steps {back + 1}-{step}", data_position)
      self.goodput.add("anomaly", time.perf_counter() - t + seconds)
      self.rollbacks += 1
      self.step = back
      self.detector.reset()
      self.writer.advance(-1)
      return True
    action = ("update skipped" if metrics["skipped"] else
              "update applied (policy 'skip' can only skip non-finite steps)")
    self.anomalies.write(step, reason, action, data_position)
    return False

  def log(self, metrics: dict) -> None:
    """Every log_every steps (and the last): metrics, throughput, MFU, validation."""
    c, step = self.config, self.step
    if not (step % c.log_every == 0 or step == self.end):
      return
    last = dict(metrics)
    elapsed = time.perf_counter() - self.window_start
    if self.window_tokens:
      last["tokens_per_s"] = self.window_tokens / elapsed
      last["mfu"] = last["tokens_per_s"] * self.flops_per_token / (self.peak * jax.device_count())
    if step % c.eval_every == 0 or step == c.steps:
      last.update(self.validation_metrics())
    self.writer.write(step, last)
    self.goodput.save()
    self.window_start, self.window_tokens = time.perf_counter(), 0.0
    self.last = last

  def checkpoint_and_gate(self) -> None:
    """Checkpoints every checkpoint_every steps, the last and every gated step; then gates."""
    c, step = self.config, self.step
    gated = self.gate_run is not None and self.gate_run.due(step, c.steps)
    if step % c.checkpoint_every == 0 or step == self.end or gated:
      self.save()
    if gated:  # promote this checkpoint only if its evaluation passes the gate
      t = time.perf_counter()
      self.gate_run.check(step, self.task.eval_model(self.state, self.frozen))
      self.goodput.add("eval", time.perf_counter() - t)

  def finish(self) -> None:
    if hasattr(self.task, "finish") and self.step == self.config.steps:
      self.task.finish(self.state, self.frozen, self.step, self.plan)  # e.g. LoRA's merge

  def close(self) -> None:
    self.watchdog.close()
    t = time.perf_counter()
    self.ckpt.close()
    self.goodput.add("checkpoint", time.perf_counter() - t)
    self.goodput.save()
    self.writer.close()

  def report(self) -> dict:
    """Prints the goodput summary; returns the last logged metrics."""
    summary = self.goodput.summary()
    if jax.process_index() == 0:
      parts = ", ".join(f"{k} {v:.1f}s" for k, v in summary["seconds"].items() if v)
      print(f"meshlm: goodput {summary['goodput']:.1%} over {summary['total_seconds']:.1f}s "
            f"and {summary['restarts']} restart(s) ({parts}); {self.anomalies.count} anomalies",
            flush=True)
    return self.last
