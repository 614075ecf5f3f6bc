"""Step-time overhead of asynchronous vs synchronous checkpoints (train/checkpoint.py).

    python benchmarks/checkpoint.py --json                        # ~10M params, ~120 MB state
    python benchmarks/checkpoint.py --json --compress             # zstd-compressed arrays
    python benchmarks/checkpoint.py --d-model 32 --layers 1 --vocab 128 --periods 1   # smoke

For each mode (Checkpointer(async_save=True/False)) the real jitted train step
runs in 10-step periods, alternating periods without a save and periods that
start with a save, so that load from other processes hits both alike. A period
with a save is timed from the save call until its write is complete (async:
`wait()` after the 10th step, since the next save would block on it anyway), so
background writing that slows the steps or outlasts them is counted. Overhead =
(mean saving period - mean plain period) / mean plain period, i.e. the extra
fraction of a step averaged over a checkpoint every `--every` steps.

Checkpoints go to a temporary directory that is removed afterwards. One JSON
document goes to stdout; progress text goes to stderr.
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks.common import log  # noqa: E402

TARGET_OVERHEAD = 0.10  # async: at most 10% of a step, averaged over a checkpoint every 10 steps


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="compact JSON on stdout")
  p.add_argument("--every", type=int, default=10, help="steps per checkpoint period")
  # 32: with 4 or 8 periods single runs spread over 5-11% on a shared 2-core host, as wide as
  # the 10% target's margin (docs/notes/checkpoint_overhead.md); 32 periods take ~2 minutes
  # per mode at ~120 MB.
  p.add_argument("--periods", type=int, default=32,
                 help="periods with a save (and as many without)")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--mlp", type=int, default=1408)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--modes", default="async,sync", help="comma-separated: async, sync")
  p.add_argument("--dir", default=None, help="parent of the temporary checkpoint directory")
  p.add_argument("--compress", action="store_true",
                 help="zstd-compressed arrays (train config checkpoint_compression=True)")
  p.add_argument("--idle-writer", action="store_true", help="Checkpointer(idle_writer=True)")
  args = p.parse_args(argv)
  if args.every < 1 or args.periods < 1:
    p.error("--every and --periods must be >= 1")
  return args


def build(args):
  """(step function, initial state, batch maker) for a Llama-shaped model with AdamW."""
  import jax
  from jax.sharding import NamedSharding
  from ml_collections import ConfigDict

  import parallel
  from models import ModelConfig
  from train.optimizer import make_optimizer
  from train.state import create_train_state
  from train.step import jit_train_step

  cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, mlp_dim=args.mlp,
                    tie_embeddings=False, max_seq_len=args.seq)
  opt = ConfigDict(dict(lr=3e-4, warmup_steps=0, min_lr_ratio=1.0, b1=0.9, b2=0.95, eps=1e-8,
                        weight_decay=0.1, clip_norm=1.0))
  tx, schedule = make_optimizer(opt, 10_000)
  mesh = parallel.make_mesh({"data": -1})
  layout = parallel.get_layout("data_parallel")
  with parallel.axis_rules(layout.rules):
    graphdef, state, shardings = create_train_state(cfg, tx, mesh, 0, layout)
    batch_sharding = NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step_fn = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding)
  ones = np.ones((args.batch, args.seq), np.int32)
  positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), ones.shape)

  def batch_for(index):
    toks = np.random.default_rng(int(index)).integers(0, args.vocab, (args.batch, args.seq + 1),
                                                      dtype=np.int32)
    return jax.device_put({"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": ones,
                           "positions": positions}, batch_sharding)

  return cfg, step_fn, state, batch_for, (mesh, layout)


def run_mode(mode, args, step_fn, state, batch_for, directory):
  """Alternating plain and saving periods with one Checkpointer; returns (stats, state)."""
  import grain
  import jax

  from train.checkpoint import Checkpointer

  # A real grain iterator: its position is part of every checkpoint, as in train/loop.py.
  data_iter = iter(grain.MapDataset.range(10 ** 9).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  ckpt = Checkpointer(directory, keep=2, async_save=mode == "async", compress=args.compress,
                      idle_writer=args.idle_writer)
  step_times, plain, saving, blocking, drain = [], [], [], [], []
  plain_cpu, saving_cpu = [], []
  saved = [0]

  def steps(n):
    nonlocal state
    for _ in range(n):
      t = time.perf_counter()
      state, metrics = step_fn(state, batch_for(next(data_iter)))
      float(metrics["loss"])  # synchronises, like the loop's device_get of the metrics
      step_times.append(time.perf_counter() - t)

  def save():
    saved[0] += 1
    t = time.perf_counter()
    ckpt.save(saved[0], state, data_iter, {"benchmark": "checkpoint"}, force=True)
    blocking.append(time.perf_counter() - t)

  steps(2)  # compile, then one more step outside the measurement
  save()    # the first save creates directories and metadata: untimed
  ckpt.wait()
  step_times.clear()
  blocking.clear()
  for _ in range(args.periods):
    t, c = time.perf_counter(), cpu_seconds()
    steps(args.every)
    plain.append(time.perf_counter() - t)
    plain_cpu.append(cpu_seconds() - c)
    t, c = time.perf_counter(), cpu_seconds()
    save()
    steps(args.every)
    w = time.perf_counter()
    ckpt.wait()
    drain.append(time.perf_counter() - w)
    saving.append(time.perf_counter() - t)
    saving_cpu.append(cpu_seconds() - c)
  ckpt.close()
  newest = os.path.join(ckpt.directory, str(saved[0]))
  on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(newest)
                for f in files)
  jax.block_until_ready(state)
  plain_step = statistics.fmean(plain) / args.every
  saving_steps = [s for i, s in enumerate(step_times) if (i // args.every) % 2 == 1]
  plain_only = [s for i, s in enumerate(step_times) if (i // args.every) % 2 == 0]
  overhead = (statistics.fmean(saving) - statistics.fmean(plain)) / statistics.fmean(plain)
  overhead_median = (statistics.median(saving) - statistics.median(plain)) / statistics.median(plain)
  stats = {
      "step_time_no_checkpoint_mean_s": plain_step,
      "step_time_no_checkpoint_median_s": statistics.median(plain_only),
      # Steps of the saving periods; their sum plus the save call and drain is the period.
      "step_time_with_checkpoint_mean_s": statistics.fmean(saving) / args.every,
      "step_time_while_writing_median_s": statistics.median(saving_steps),
      # Where the cost lands: mean time of the k-th step after the save call.
      "step_time_after_save_by_position_s": [
          statistics.fmean(saving_steps[k::args.every]) for k in range(args.every)],
      "period_no_checkpoint_s": plain, "period_with_checkpoint_s": saving,
      "overhead_fraction": overhead, "overhead_fraction_median": overhead_median,
      "save_blocking_mean_s": statistics.fmean(blocking),
      "save_blocking_max_s": max(blocking),
      # The overhead if the background write cost no step time (idle host cores, as on GPUs).
      "blocking_overhead_fraction": statistics.fmean(blocking) / statistics.fmean(plain),
      "drain_after_period_mean_s": statistics.fmean(drain),
      "overhead_seconds_per_checkpoint": overhead * statistics.fmean(plain),
      # This process's CPU time (all threads) a save adds to its period: the write's own cost
      # plus whatever the step loses to sharing cores with it.
      "process_cpu_per_checkpoint_s": statistics.fmean(saving_cpu) - statistics.fmean(plain_cpu),
      "process_cpu_period_no_checkpoint_s": statistics.fmean(plain_cpu),
      "checkpoint_bytes_on_disk": on_disk,
      "saves": len(blocking), "steps_timed": len(step_times),
  }
  log(f"{mode}: plain step {plain_step * 1e3:.0f} ms, save call {stats['save_blocking_mean_s']:.3f}"
      f" s, overhead {overhead:+.1%} of a step at a checkpoint every {args.every} steps")
  return stats, state


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def state_bytes(state):
  import jax
  leaves = jax.tree.leaves(state)
  params = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
  return sum(x.nbytes for x in leaves), params


def main(argv=None):
  args = parse_args(argv)
  import jax
  import orbax.checkpoint as ocp
  load_start = os.getloadavg()[0]
  cfg, step_fn, state, batch_for, _ = build(args)
  total, params = state_bytes(state)
  log(f"{cfg.num_params():,} params, train state {total / 1e6:.1f} MB; checkpoint every "
      f"{args.every} steps, {args.periods} saving + {args.periods} plain periods per mode")
  parent = tempfile.mkdtemp(prefix="meshlm_ckpt_bench_", dir=args.dir)
  modes = {}
  try:
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
      if mode not in ("async", "sync"):
        raise SystemExit(f"--modes: unknown mode {mode!r}")
      modes[mode], state = run_mode(mode, args, step_fn, state, batch_for,
                                    os.path.join(parent, mode))
  finally:
    shutil.rmtree(parent, ignore_errors=True)
  result = {
      "benchmark": "checkpoint",
      "config": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                 "kv_heads": args.kv_heads, "mlp": args.mlp, "vocab": args.vocab,
                 "batch": args.batch, "seq": args.seq, "tie_embeddings": False,
                 "optimizer": "adamw", "num_params": cfg.num_params()},
      "checkpoint_every": args.every, "periods": args.periods, "compressed": args.compress,
      "state_bytes": total, "param_bytes": params,
      "env": {"jax": jax.__version__, "orbax": ocp.__version__, "python": platform.python_version(),
              "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
              "loadavg_1m": [load_start, os.getloadavg()[0]]},
      "modes": modes, "target_overhead": TARGET_OVERHEAD,
      "target_met": (modes["async"]["overhead_fraction"] <= TARGET_OVERHEAD
                     if "async" in modes else None),
  }
  if "async" in modes and "sync" in modes:
    result["sync_over_async_overhead"] = (modes["sync"]["overhead_seconds_per_checkpoint"] /
                                          max(modes["async"]["overhead_seconds_per_checkpoint"],
                                              1e-9))
  print(json.dumps(result) if args.json else json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
