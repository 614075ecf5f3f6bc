"""Pieces every benchmark shares: logging, CPU count, and a train step wired as train/loop.py does."""

import os
import sys


def log(msg):
  print(msg, file=sys.stderr, flush=True)


def cpu_count():
  try:
    return len(os.sched_getaffinity(0))  # respects taskset/cgroup pinning, unlike os.cpu_count
  except AttributeError:
    return os.cpu_count() or 1


def constant_lr_step(cfg, hp: dict, total_steps: int, seed: int):
  """(step_fn, state, batch_sharding, mesh, layout): jitted, donated, data parallel.

  warmup_steps=0 and min_lr_ratio=1 turn warmup-cosine into a constant lr.
  `hp` has lr, b1, b2, eps, weight_decay, clip_norm.
  """
  from jax.sharding import NamedSharding
  from ml_collections import ConfigDict

  import parallel
  from train.optimizer import make_optimizer
  from train.state import create_train_state
  from train.step import jit_train_step

  opt = ConfigDict(dict(lr=hp["lr"], warmup_steps=0, min_lr_ratio=1.0, b1=hp["b1"], b2=hp["b2"],
                        eps=hp["eps"], weight_decay=hp["weight_decay"],
                        clip_norm=hp["clip_norm"]))
  tx, schedule = make_optimizer(opt, total_steps)
  mesh = parallel.make_mesh({"data": -1})
  layout = parallel.get_layout("data_parallel")
  with parallel.axis_rules(layout.rules):
    graphdef, state, shardings = create_train_state(cfg, tx, mesh, seed, layout)
    batch_sharding = NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step_fn = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding)
  return step_fn, state, batch_sharding, mesh, layout


def token_step_runner(step_fn, state, batch_sharding, batch: int, seq: int):
  """run_step(tokens_BT1) -> the step's metrics (on device), advancing the donated state.

  tokens_BT1 is [batch, seq + 1] ids; every row is one document. The host->device copy
  stays inside the step, as in train/loop.py.
  """
  import jax
  import numpy as np

  ones = np.ones((batch, seq), np.int32)
  positions = np.broadcast_to(np.arange(seq, dtype=np.int32), ones.shape)

  def run_step(toks):
    nonlocal state
    batch_ = jax.device_put({"inputs": toks[:, :-1], "targets": toks[:, 1:],
                             "segment_ids": ones, "positions": positions}, batch_sharding)
    state, metrics = step_fn(state, batch_)
    return metrics

  return run_step
