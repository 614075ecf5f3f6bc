"""The pretraining loop: steps, evaluation, checkpoints, and what to do when things fail.

Started again with the same config and workdir, a run resumes from the newest
readable checkpoint: parameters, optimizer, step, RNG and the data iterator's
position, so the losses after a restart are bit-identical to an uninterrupted
run's. See docs/fault_tolerance.md for every failure mode.
"""

import itertools
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

import parallel
from train import data as data_lib
from train import flops as flops_lib
from train.checkpoint import Checkpointer
from train.fault import AnomalyDetector, AnomalyLog, Goodput, Preempted, PreemptionGuard
from train.metrics import MetricsWriter
from train.optimizer import make_optimizer
from train.setup import plan_run
from train.state import create_train_state
from train.step import jit_eval_step, jit_train_step
from train.watchdog import Watchdog


def evaluate(eval_fn, params, val_ds, batch_sharding, num_batches: int) -> float:
  """Mean per-token loss over the first `num_batches` validation batches."""
  total, count = 0.0, 0.0
  for batch in itertools.islice(iter(val_ds), num_batches):
    loss_sum, n = eval_fn(params, _to_global(batch, batch_sharding))
    total, count = total + float(loss_sum), count + float(n)
  return total / max(count, 1.0)


def _to_global(batch, sharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def train(config: ConfigDict, workdir: str, stop_at: int | None = None) -> dict:
  """Runs (or resumes) training; returns the last logged metrics.

  `stop_at` ends this invocation early, after checkpointing that step, as a
  preemption would; the schedule still spans `config.steps`. Raises Preempted
  (after checkpointing) on SIGTERM/SIGINT.
  """
  workdir = os.path.abspath(workdir)
  plan = plan_run(config, workdir)
  mesh, layout = plan.mesh, plan.layout
  goodput = Goodput(workdir)
  started = time.perf_counter()

  datasets = {split: data_lib.make_global_dataset(
      config.data, plan.tokenizer, seq_len=config.seq_len, global_batch_size=config.batch_size,
      split=split, seed=config.seed, num_shards=config.data.num_shards,
      arch=plan.model_cfg.arch, vocab_size=plan.model_cfg.vocab_size)
      for split in ("train", "validation")}
  train_iter = iter(datasets["train"])

  tx, schedule = make_optimizer(config.optimizer, config.steps)
  with parallel.axis_rules(layout.rules):
    graphdef, state, shardings = create_train_state(plan.model_cfg, tx, mesh, config.seed,
                                                    layout, params=plan.init_params)
  batch_sharding = NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
  make_step = lambda nan=False: jit_train_step(graphdef, tx, schedule, shardings, batch_sharding,
                                               config.grad_accum, inject_nan=nan)
  step_fn = make_step()
  eval_fn = jit_eval_step(graphdef, shardings["params"], batch_sharding)

  ckpt = Checkpointer(workdir, config.keep_checkpoints, config.async_checkpoints,
                      config.keep_checkpoint_every)
  goodput.add("startup", time.perf_counter() - started)
  if ckpt.latest_step() is not None:
    t = time.perf_counter()
    state, _ = ckpt.restore(state, train_iter)
    goodput.add("restore", time.perf_counter() - t)
  start = int(state["step"])
  config_json = config.to_dict()

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
      while step < end:
        if preemption.requested():
          if ckpt.latest_step() != step:
            save(step)
          ckpt.wait()
          raise Preempted(step, preemption.signum)
        watchdog.step_started(step)
        t = time.perf_counter()
        batch = _to_global(next(train_iter), batch_sharding)
        inject = step + 1 == config.debug.nan_at_step and not rollbacks  # once, not on replay
        fn = make_step(nan=True) if inject else step_fn
        state, metrics = fn(state, batch)
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
          window_tokens += config.batch_size * config.seq_len
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
            last["val_loss"] = evaluate(eval_fn, state["params"], datasets["validation"],
                                        batch_sharding, config.eval_batches)
            goodput.add("eval", time.perf_counter() - t)
          writer.write(step, last)
          goodput.save()
          window_start, window_tokens = time.perf_counter(), 0.0
        if step % config.checkpoint_every == 0 or step == end:
          save(step)
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
