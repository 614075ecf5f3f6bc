"""CPU cost of writing one checkpoint of benchmarks/checkpoint.py's train state, by layer.

    python benchmarks/checkpoint_cost.py --json            # ~120 MB of state, 8 rounds
    python benchmarks/checkpoint_cost.py --rounds 2 --d-model 32 --layers 1 --vocab 128   # smoke

Other flags (--d-model, --layers, ...) pick the model as in benchmarks/checkpoint.py.

What the asynchronous write costs the host, with no training step running: the
process's CPU seconds (all threads) from the start of a save until it is on disk,
for the same state written four ways, interleaved round by round:

- `orbax`: train/checkpoint.py's Checkpointer, as the training loop saves (the
  save call, then Orbax's and TensorStore's background threads until `wait()`);
- `tensorstore`: the same arrays written straight through TensorStore's zarr3
  driver on an OCDBT store (Orbax's format), without Orbax;
- `file`: the arrays' bytes written to plain files, one per array (the floor for
  putting these bytes on disk through the page cache);
- `host_copy`: only copying the arrays to host memory (what a save must do
  before the next step may donate them).

Each written copy is deleted before the next round, as `keep` does in a run, so
that dirty pages do not pile up. On a host where the training step runs on the
same cores as the write (a CPU-only host), this CPU time is what a save can take
from the steps that overlap it. One JSON document goes to stdout.
"""

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks import checkpoint as bench  # noqa: E402
from benchmarks.common import log  # noqa: E402


def write_orbax(ckpt, step, state, data_iter):
  ckpt.save(step, state, data_iter, {"benchmark": "checkpoint_cost"}, force=True)
  ckpt.wait()


def write_tensorstore(directory, leaves, context):
  import tensorstore as ts
  stores = [ts.open({"driver": "zarr3", "path": f"a{i}",
                     "kvstore": {"driver": "ocdbt", "base": f"file://{directory}/"},
                     "metadata": {"shape": list(x.shape), "data_type": str(x.dtype)}},
                    create=True, context=context).result() for i, x in enumerate(leaves)]
  for future in [s.write(x, can_reference_source_data_indefinitely=True)
                 for s, x in zip(stores, leaves)]:
    future.result()


def write_files(directory, leaves):
  os.makedirs(directory)
  for i, x in enumerate(leaves):
    with open(os.path.join(directory, f"a{i}"), "wb") as f:
      f.write(memoryview(np.ascontiguousarray(x)).cast("B"))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="compact JSON on stdout")
  p.add_argument("--rounds", type=int, default=8, help="rounds; the first is not counted")
  args, model_flags = p.parse_known_args(argv)
  if args.rounds < 2:
    p.error("--rounds must be >= 2 (the first round is a warm-up)")
  import grain
  import jax
  import orbax.checkpoint as ocp
  import tensorstore as ts

  from train.checkpoint import Checkpointer

  model_args = bench.parse_args(["--periods", "1", *model_flags])  # that benchmark's model
  cfg, step_fn, state, batch_for, _ = bench.build(model_args)
  data_iter = iter(grain.MapDataset.range(10 ** 9).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  state, metrics = step_fn(state, batch_for(next(data_iter)))
  float(metrics["loss"])
  leaves = jax.tree.leaves(state)
  total = sum(x.nbytes for x in leaves)
  host = [np.asarray(x) for x in leaves]
  log(f"{cfg.num_params():,} params, train state {total / 1e6:.1f} MB in {len(leaves)} arrays")
  parent = tempfile.mkdtemp(prefix="meshlm_ckpt_cost_")
  ckpt = Checkpointer(os.path.join(parent, "orbax"), keep=1)
  context = ts.Context({"file_io_concurrency": {"limit": 128}})
  cpu = {k: [] for k in ("orbax", "tensorstore", "file", "host_copy")}
  wall = {k: [] for k in cpu}
  held = []
  try:
    for r in range(args.rounds):
      for kind in cpu:
        where = os.path.join(parent, f"{kind}{r}")
        t, c = time.perf_counter(), bench.cpu_seconds()
        if kind == "orbax":
          write_orbax(ckpt, r + 1, state, data_iter)
        elif kind == "tensorstore":
          write_tensorstore(where, host, context)
        elif kind == "file":
          write_files(where, host)
        else:
          held[:] = [np.array(x, copy=True) for x in leaves]
        c, t = bench.cpu_seconds() - c, time.perf_counter() - t
        held.clear()  # freed outside the timing
        shutil.rmtree(where, ignore_errors=True)
        if r:  # the first round warms caches and starts thread pools
          cpu[kind].append(c)
          wall[kind].append(t)
    ckpt.close()
  finally:
    shutil.rmtree(parent, ignore_errors=True)
  floor = statistics.median(cpu["file"])
  result = {
      "benchmark": "checkpoint_cost", "state_bytes": total, "arrays": len(leaves),
      "rounds_counted": args.rounds - 1,
      "cpu_s_median": {k: statistics.median(v) for k, v in cpu.items()},
      "cpu_s_min": {k: min(v) for k, v in cpu.items()},
      "wall_s_median": {k: statistics.median(v) for k, v in wall.items()},
      # None where the file write's CPU time rounds to zero (a tiny state)
      "cpu_over_file": {k: (statistics.median(v) / floor if floor > 0 else None)
                        for k, v in cpu.items()},
      "env": {"jax": jax.__version__, "orbax": ocp.__version__,
              "tensorstore": importlib.metadata.version("tensorstore"),
              "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
  }
  for k in cpu:
    ratio = result["cpu_over_file"][k]
    log(f"{k:12s} CPU {result['cpu_s_median'][k] * 1e3:6.0f} ms (median)" +
        (f", {ratio:.1f}x a plain file write" if ratio is not None else ""))
  print(json.dumps(result) if args.json else json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
