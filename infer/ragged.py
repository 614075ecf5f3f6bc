"""Ragged paged attention: each query attends over its own row's pages only, read in place.

The gathering path (infer/paged.py) lays every row out to the batch's widest
block table, so a decode step of eight rows whose longest holds 300 tokens
reads 8 × 512 slots. Here the step's pages in use are listed once, flat: page
p of the list belongs to row `row_P[p]` and is block `block_P[p]` of that
row's table. Scores are taken page by page against the owning row's queries,
and the softmax is a segmented one over each row's pages plus the chunk's own
keys. Work is proportional to the pages in use, not to rows × widest row.

Only float pools read in place take this path (`paged.forward(ragged=...)`),
pure JAX on every backend. PagedEngine takes it for decode steps on CPU
(`ragged_decode`), where it was measured faster than the tables
(docs/results.md); the TPU keeps its Pallas paged-attention kernel.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


class RaggedPages(NamedTuple):
  """The pages a step reads, flat and grouped by row (rows ascending)."""
  page_P: jax.Array   # int32 page ids; NULL_PAGE pads the list to its bucket
  row_P: jax.Array    # the row each page belongs to (padding: the last row)
  block_P: jax.Array  # the page's index in its row's block table; -1 marks padding


def build(tables: list[list[int]], ends: list[int], rows: int, page_size: int,
          size: int) -> RaggedPages:
  """Host side: row i's first ceil(ends[i] / page_size) pages of tables[i], flat, padded to
  `size` entries. `ends[i]`: the tokens row i holds once this step's chunk is written."""
  if len(tables) != len(ends) or len(tables) > rows:
    raise ValueError(f"{len(tables)} tables and {len(ends)} ends for {rows} rows")
  page, row, block = [], [], []
  for i, (table, end) in enumerate(zip(tables, ends)):
    n = -(-end // page_size)
    if n > len(table):
      raise ValueError(f"row {i} holds {end} tokens but its table lists {len(table)} pages")
    page += table[:n]
    row += [i] * n
    block += range(n)
  if len(page) > size:
    raise ValueError(f"{len(page)} pages in use do not fit a ragged list of {size}")
  pad = size - len(page)
  as_array = lambda xs, fill: np.asarray(list(xs) + [fill] * pad, np.int32)
  return RaggedPages(as_array(page, NULL_PAGE), as_array(row, rows - 1), as_array(block, -1))


def count(ends: list[int], page_size: int) -> int:
  """How many pages `build` lists for these rows."""
  return sum(-(-end // page_size) for end in ends)


def pages_of_tokens(pages: RaggedPages, block_BT):
  """[B, T]: the page holding block block_BT[b, t] of row b, looked up in the flat list
  (NULL_PAGE where the list has none)."""
  b = block_BT.shape[0]
  hit_BTP = ((pages.row_P[None, None, :] == jnp.arange(b)[:, None, None])
             & (pages.block_P[None, None, :] == block_BT[:, :, None]))
  return jnp.sum(jnp.where(hit_BTP, pages.page_P[None, None, :], NULL_PAGE), axis=-1)


def attend(q_BTNH, k_BTKH, v_BTKH, k_LKWZH, v_LKWZH, layer, pages: RaggedPages, start_B,
           positions_BT, segment_ids_BT, cfg):
  """Causal attention of a right-padded chunk over each row's cached pages and the chunk.

  Keys cached before the chunk (positions < start_B[b]) come from the pool, in place; the
  chunk's own keys come from k_BTKH, causally and real tokens only (segment id > 0).
  """
  _, k, _, z, h = k_LKWZH.shape
  b, t, n, _ = q_BTNH.shape
  g = n // k
  dtype = q_BTNH.dtype
  q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
  q_KPGTH = jnp.transpose(q_BTKGH, (2, 0, 3, 1, 4))[:, pages.row_P]
  k_KPZH = k_LKWZH[layer][:, pages.page_P].astype(dtype)
  v_KPZH = v_LKWZH[layer][:, pages.page_P].astype(dtype)
  old_KPGTZ = jnp.einsum("KPGTH,KPZH->KPGTZ", q_KPGTH, k_KPZH).astype(jnp.float32) * cfg.scale
  # the chunk's own keys, at key positions S (the same positions as its queries T)
  new_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BTKH.astype(dtype)).astype(
      jnp.float32) * cfg.scale

  pos_PZ = pages.block_P[:, None] * z + jnp.arange(z, dtype=jnp.int32)
  old_PTZ = ((pages.block_P >= 0)[:, None, None]
             & (pos_PZ < start_B[pages.row_P][:, None])[:, None, :])
  new_BTS = ((positions_BT[:, None, :] <= positions_BT[:, :, None])
             & (segment_ids_BT > 0)[:, None, :])
  if cfg.sliding_window:
    q_pos_PT = positions_BT[pages.row_P]
    old_PTZ = old_PTZ & (pos_PZ[:, None, :] > q_pos_PT[:, :, None] - cfg.sliding_window)
    new_BTS = new_BTS & (positions_BT[:, None, :] > positions_BT[:, :, None] - cfg.sliding_window)
  old_KPGTZ = jnp.where(old_PTZ[None, :, None], old_KPGTZ, -jnp.inf)
  new_BKGTS = jnp.where(new_BTS[:, None, None], new_BKGTS, -jnp.inf)

  # A segmented softmax: the max and the sums run over each row's pages, then its chunk.
  segment = lambda x_P, op: op(x_P, pages.row_P, num_segments=b, indices_are_sorted=True)
  max_PKGT = jnp.moveaxis(jnp.max(old_KPGTZ, axis=-1), 1, 0)
  max_BKGT = jnp.maximum(segment(max_PKGT, jax.ops.segment_max), jnp.max(new_BKGTS, axis=-1))
  max_BKGT = jnp.where(jnp.isfinite(max_BKGT), max_BKGT, 0.0)  # rows that see nothing
  old_KPGTZ = jnp.exp(old_KPGTZ - jnp.moveaxis(max_BKGT[pages.row_P], 0, 1)[..., None])
  new_BKGTS = jnp.exp(new_BKGTS - max_BKGT[..., None])
  sum_BKGT = (segment(jnp.moveaxis(jnp.sum(old_KPGTZ, axis=-1), 1, 0), jax.ops.segment_sum)
              + jnp.sum(new_BKGTS, axis=-1))
  # per-page partial sums stay float32 until the division (one rounding, as in attention())
  out_PKGTH = jnp.einsum("KPGTZ,KPZH->PKGTH", old_KPGTZ.astype(dtype), v_KPZH,
                         preferred_element_type=jnp.float32)
  out_BKGTH = (segment(out_PKGTH, jax.ops.segment_sum)
               + jnp.einsum("BKGTS,BSKH->BKGTH", new_BKGTS.astype(dtype), v_BTKH.astype(dtype),
                            preferred_element_type=jnp.float32))
  out_BKGTH = out_BKGTH / jnp.where(sum_BKGT > 0, sum_BKGT, 1.0)[..., None]
  return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(dtype)
