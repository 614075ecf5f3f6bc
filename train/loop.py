"""The pretraining loop: steps, evaluation, checkpoints, and what to do when things fail.

Started again with the same config and workdir, a run resumes from the newest
readable checkpoint: parameters, optimizer, step, RNG and the data iterator's
position, so the losses after a restart are bit-identical to an uninterrupted
run's. See docs/fault_tolerance.md for every failure mode.
"""

import os
import time

import jax
from ml_collections import ConfigDict

import parallel
from train import flops as flops_lib
from train.checkpoint import Checkpointer
from train.fault import AnomalyDetector, AnomalyLog, Goodput, Preempted, PreemptionGuard
from train.metrics import MetricsWriter
from train.optimizer import make_optimizer
from train.setup import plan_run
from train.task import LMTask, batch_sharding as make_batch_sharding, first, to_global
from train.watchdog import Watchdog


def train(config: ConfigDict, workdir: str, stop_at: int | None = None, task=None) -> dict:
  """Runs (or resumes) training of `task` (default: LMTask, pretraining); returns the last
  logged metrics.

  `stop_at` ends this invocation early, after checkpointing that step, as a
  preemption would; the schedule still spans `config.steps`. Raises Preempted
  (after checkpointing) on SIGTERM/SIGINT.
  """
  workdir = os.path.abspath(workdir)
  task = LMTask(config) if task is None else task
  gate_cfg = config.get("eval_gate")
  if gate_cfg and gate_cfg.every:
    from align.evals import promote  # align imports train; only gated runs need it
    if not hasattr(task, "eval_model"):
      raise ValueError(f"eval_gate: the {task.name} task has no generating model to evaluate")
    promote.validate(gate_cfg, jax.process_count(), config.data.get("decontam"),
                     task_name=task.name, arch=config.model.arch)
  datasets = {}  # loaded (and a task's data checked) before the workdir is written to
  plan = plan_run(config, workdir, before_write=lambda p: datasets.update(task.datasets(p)))
  mesh, layout = plan.mesh, plan.layout
  goodput = Goodput(workdir)
  started = time.perf_counter()
  train_iter = iter(datasets["train"])

  tx, schedule = make_optimizer(config.optimizer, config.steps)
  with parallel.axis_rules(layout.rules):
    state, shardings, frozen, frozen_shardings = task.init_state(plan, tx, mesh, layout)
  batch_sharding = make_batch_sharding(mesh)
  make_step = lambda nan=False: task.step_fn(tx, schedule, shardings, frozen_shardings,
                                             batch_sharding, inject_nan=nan)
  step_fn = make_step()

  ckpt = Checkpointer(workdir, config.keep_checkpoints, config.async_checkpoints,
                      config.keep_checkpoint_every, config.checkpoint_compression,
                      config.get("checkpoint_idle_writer", False))
  goodput.add("startup", time.perf_counter() - started)
  if ckpt.latest_step() is not None:
    t = time.perf_counter()
    state, _ = ckpt.restore(state, train_iter)
    goodput.add("restore", time.perf_counter() - t)
  start = int(state["step"])
  config_json = config.to_dict()
  promoter = None
  if gate_cfg and gate_cfg.every:  # evaluates the starting model as the baseline if needed
    t = time.perf_counter()
    with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
      promoter = promote.Promoter(gate_cfg, workdir, plan, task.eval_model(state, frozen), start)
    goodput.add("eval", time.perf_counter() - t)

  flops_per_token = flops_lib.train_flops_per_token(plan.model_cfg, config.seq_len)
  peak, peak_source = flops_lib.peak_flops_per_device(plan.model_cfg.jnp_dtype,
                                                      config.peak_flops_per_device)
  writer = MetricsWriter(workdir, config.steps, start)
  anomalies, detector = AnomalyLog(workdir), AnomalyDetector(config.anomaly.window,
                                                             config.anomaly.zscore)
  if jax.process_index() == 0:
    print(f"meshlm: {plan.model_cfg.num_params():,} params, "
          f"{jax.device_count()} device(s) in {jax.process_count()} process(es), "
          f"mesh {dict(mesh.shape)}, MFU peak {peak / 1e9:.1f} GFLOP/s per device "
          f"({peak_source}); starting at step {start}/{config.steps}", flush=True)

  def save(step, force=True):
    t = time.perf_counter()
    ckpt.save(step, state, train_iter, config_json, force=force)
    goodput.add("checkpoint", time.perf_counter() - t)

  watchdog = Watchdog(config.watchdog.factor, config.watchdog.min_seconds,
                      os.path.join(workdir, f"watchdog_{jax.process_index()}.log"))
  last, rollbacks, compiled = {}, 0, False
  window_start, window_tokens = time.perf_counter(), 0.0
  stop_at = stop_at or config.stop_at_step or None
  end = config.steps if stop_at is None else min(stop_at, config.steps)
  step = start
  try:
    with (parallel.axis_rules(layout.rules), jax.set_mesh(mesh),
          parallel.pipeline_schedule(plan.pipeline), PreemptionGuard() as preemption):
      if step == 0 and config.eval_at_start:  # the starting model's baseline
        t = time.perf_counter()
        writer.write(0, task.evaluate(state["params"], frozen,
                                      first(datasets["validation"], config.eval_batches),
                                      batch_sharding))
        goodput.add("eval", time.perf_counter() - t)
      while step < end:
        if preemption.requested():
          if ckpt.latest_step() != step:
            save(step)
          ckpt.wait()
          raise Preempted(step, preemption.signum)
        watchdog.step_started(step)
        t = time.perf_counter()
        batch = next(train_iter)
        if hasattr(task, "prepare"):  # on-policy tasks (PPO, GRPO) roll out here
          batch = task.prepare(state, frozen, batch, step)
        batch = to_global(batch, batch_sharding)
        inject = step + 1 == config.debug.nan_at_step and not rollbacks  # once, not on replay
        fn = make_step(nan=True) if inject else step_fn
        state, metrics = fn(state, batch, frozen)
        if step + 1 == config.debug.slow_step_at:
          time.sleep(config.debug.slow_step_seconds)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        seconds = time.perf_counter() - t
        watchdog.step_finished(step, seconds)
        step += 1
        if not compiled:  # the first step of each start pays for compilation
          goodput.add("compile", seconds)
          compiled, window_start = True, time.perf_counter()
        else:
          goodput.step_done(step, seconds)
          window_tokens += task.tokens_per_step
        writer.advance()

        reason = detector.check(metrics["loss"], metrics["grad_norm"])
        if reason:
          data_position = train_iter.get_state()
          back = ckpt.latest_step()
          if (config.anomaly.policy == "rollback" and back is not None
              and rollbacks < config.anomaly.max_rollbacks):
            ckpt.wait()
            t = time.perf_counter()
            state, back = ckpt.restore(state, train_iter)
            for _ in range(step - back):  # skip the data window that led here
              next(train_iter)
            anomalies.write(step, reason, f"rolled back to step {back}; skipped the data of "
                            f"steps {back + 1}-{step}", data_position)
            goodput.add("anomaly", time.perf_counter() - t + seconds)
            rollbacks += 1
            step = back
            detector.reset()
            writer.advance(-1)
            continue
          action = ("update skipped" if metrics["skipped"] else
                    "update applied (policy 'skip' can only skip non-finite steps)")
          anomalies.write(step, reason, action, data_position)

        if step % config.log_every == 0 or step == end:
          last = dict(metrics)
          elapsed = time.perf_counter() - window_start
          if window_tokens:
            last["tokens_per_s"] = window_tokens / elapsed
            last["mfu"] = last["tokens_per_s"] * flops_per_token / (peak * jax.device_count())
          if step % config.eval_every == 0 or step == config.steps:
            t = time.perf_counter()
            last.update(task.evaluate(state["params"], frozen,
                                      first(datasets["validation"], config.eval_batches),
                                      batch_sharding))
            goodput.add("eval", time.perf_counter() - t)
          writer.write(step, last)
          goodput.save()
          window_start, window_tokens = time.perf_counter(), 0.0
        gated = promoter is not None and promoter.due(step, config.steps)
        if step % config.checkpoint_every == 0 or step == end or gated:
          save(step)
        if gated:  # promote this checkpoint only if its evaluation passes the gate
          t = time.perf_counter()
          promoter.check(step, task.eval_model(state, frozen))
          goodput.add("eval", time.perf_counter() - t)
    if hasattr(task, "finish") and step == config.steps:
      task.finish(state, frozen, step, plan)  # e.g. a LoRA run writes its merged model
  finally:
    watchdog.close()
    t = time.perf_counter()
    ckpt.close()
    goodput.add("checkpoint", time.perf_counter() - t)
    goodput.save()
    writer.close()
  summary = goodput.summary()
  if jax.process_index() == 0:
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in summary["seconds"].items() if v)
    print(f"meshlm: goodput {summary['goodput']:.1%} over {summary['total_seconds']:.1f}s "
          f"and {summary['restarts']} restart(s) ({parts}); {anomalies.count} anomalies",
          flush=True)
  return last
