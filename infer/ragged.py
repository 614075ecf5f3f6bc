"""Ragged paged attention: each query attends over its own row's pages only, read in place.

The gathering path (infer/paged.py) lays every row out to the batch's widest
block table, so a decode step of eight rows whose longest holds 300 tokens
reads 8 × 512 slots. Here the step's pages in use are listed once, flat, in
entries of up to GROUP consecutive pages of one row: entry p belongs to row
`row_P[p]` and holds blocks `block_P[p]`.. of that row's table (null pages
fill a row's last entry). Scores are taken entry by entry against the owning
row's queries, and the softmax is a segmented one over each row's entries
plus the chunk's own keys. Work is proportional to the pages in use (plus at
most GROUP - 1 null pages per row), not to rows × widest row. With entries of
one page the scores were hundreds of tiny batched dots per layer: a SmolLM2 CPU
decode step of eight rows over 96 pages took 50.2 ms, against 45.3 ms with four
(docs/notes/cpu_decode.md).

Only float pools read in place take this path (`paged.forward(ragged=...)`),
pure JAX on every backend. PagedEngine takes it for decode steps on CPU
(`ragged_decode`), where it was measured faster than the tables
(docs/notes/cpu_decode.md); the TPU keeps its Pallas paged-attention kernel.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import visible
from models.layers import layer_window

NULL_PAGE = 0
GROUP = 4  # pages per entry: 64 token slots at the default block size


class RaggedPages(NamedTuple):
  """The pages a step reads, flat and grouped by row (rows ascending), GROUP to an entry."""
  page_PY: jax.Array  # int32 page ids of each entry's consecutive blocks; NULL_PAGE pads
  row_P: jax.Array    # the row each entry belongs to (padding: the last row)
  block_P: jax.Array  # the entry's first block in its row's table; -1 marks padding


def build(tables: list[list[int]], ends: list[int], rows: int, page_size: int,
          size: int, group: int = GROUP) -> RaggedPages:
  """Host side: row i's first ceil(ends[i] / page_size) pages of tables[i], `group` to an
  entry, padded to `size` entries. `ends[i]`: the tokens row i holds once this step's chunk
  is written."""
  if len(tables) != len(ends) or len(tables) > rows:
    raise ValueError(f"{len(tables)} tables and {len(ends)} ends for {rows} rows")
  page, row, block = [], [], []
  for i, (table, end) in enumerate(zip(tables, ends)):
    n = _ceil_div(end, page_size)
    if n > len(table):
      raise ValueError(f"row {i} holds {end} tokens but its table lists {len(table)} pages")
    for first in range(0, n, group):
      ids = list(table[first:min(first + group, n)])
      page.append(ids + [NULL_PAGE] * (group - len(ids)))
      row.append(i)
      block.append(first)
  if len(page) > size:
    raise ValueError(f"{len(page)} entries of the pages in use do not fit a ragged list of "
                     f"{size}")
  pad = size - len(page)
  as_array = lambda xs, fill: np.asarray(list(xs) + [fill] * pad, np.int32)
  return RaggedPages(np.asarray(page + [[NULL_PAGE] * group] * pad, np.int32).reshape(size, group),
                     as_array(row, rows - 1), as_array(block, -1))


def count(ends: list[int], page_size: int, group: int = GROUP) -> int:
  """How many entries `build` lists for these rows."""
  return sum(_ceil_div(_ceil_div(end, page_size), group) for end in ends)


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def pages_of_tokens(pages: RaggedPages, block_BT):
  """[B, T]: the page holding block block_BT[b, t] of row b, looked up in the flat list
  (NULL_PAGE where the list has none)."""
  b = block_BT.shape[0]
  y = pages.page_PY.shape[1]
  block_PY = pages.block_P[:, None] + jnp.arange(y, dtype=jnp.int32)
  hit_BTPY = ((pages.row_P[None, None, :, None] == jnp.arange(b)[:, None, None, None])
              & (pages.block_P >= 0)[None, None, :, None]
              & (block_PY[None, None] == block_BT[:, :, None, None]))
  return jnp.sum(jnp.where(hit_BTPY, pages.page_PY[None, None], NULL_PAGE), axis=(-2, -1))


def attend(q_BTNH, k_BTKH, v_BTKH, k_LKWZH, v_LKWZH, layer, pages: RaggedPages, start_B,
           positions_BT, segment_ids_BT, cfg, window=None):
  """Causal attention of a right-padded chunk over each row's cached pages and the chunk.

  Keys cached before the chunk (positions < start_B[b]) come from the pool, in place; the
  chunk's own keys come from k_BTKH, causally and real tokens only (segment id > 0).
  `window`: the layer's sliding window (models.layers.layer_window; None: cfg's).
  """
  window = layer_window(cfg, None) if window is None else window
  _, k, _, z, h = k_LKWZH.shape
  b, t, n, _ = q_BTNH.shape
  g = n // k
  dtype = q_BTNH.dtype
  q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
  q_KPGTH = jnp.transpose(q_BTKGH, (2, 0, 3, 1, 4))[:, pages.row_P]
  # an entry's Y pages as one run of S = Y·Z key slots: one dot per entry, not per page
  p, y = pages.page_PY.shape
  k_KPSH = k_LKWZH[layer][:, pages.page_PY].reshape(k, p, y * z, h).astype(dtype)
  if cfg.latent_values:  # a latent cache: the values are the keys' first features
    v_KPSH, v_BTKH = k_KPSH[..., :cfg.latent_values], k_BTKH[..., :cfg.latent_values]
  else:
    v_KPSH = v_LKWZH[layer][:, pages.page_PY].reshape(k, p, y * z, -1).astype(dtype)
  old_KPGTS = jnp.einsum("KPGTH,KPSH->KPGTS", q_KPGTH, k_KPSH).astype(jnp.float32) * cfg.scale
  # the chunk's own keys, at key positions S (the same positions as its queries T)
  new_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BTKH.astype(dtype)).astype(
      jnp.float32) * cfg.scale
  if cfg.attn_softcap:  # Gemma 2, as attention() caps its scores
    cap = cfg.attn_softcap
    old_KPGTS, new_BKGTS = (jnp.tanh(old_KPGTS / cap) * cap, jnp.tanh(new_BKGTS / cap) * cap)

  # attention()'s rule (models/attention.visible), an entry's S slots as keys of its row's
  # queries: a cached key is real (segment 1) iff its entry is not padding and it precedes
  # the chunk, whose keys come from k_BTKH (so causality adds nothing there); an entry's
  # null pages lie past its row's end, so past start_B too.
  pos_PS = pages.block_P[:, None] * z + jnp.arange(y * z, dtype=jnp.int32)
  old_seg_PS = ((pages.block_P >= 0)[:, None] & (pos_PS < start_B[pages.row_P][:, None]))
  old_PTS = visible(positions_BT[pages.row_P], pos_PS, causal=True, window=window,
                    kv_seg_BS=old_seg_PS.astype(jnp.int32))
  new_BTS = visible(positions_BT, positions_BT, causal=True, window=window,
                    kv_seg_BS=segment_ids_BT)
  old_KPGTS = jnp.where(old_PTS[None, :, None], old_KPGTS, -jnp.inf)
  new_BKGTS = jnp.where(new_BTS[:, None, None], new_BKGTS, -jnp.inf)

  # A segmented softmax: the max and the sums run over each row's entries, then its chunk.
  segment = lambda x_P, op: op(x_P, pages.row_P, num_segments=b, indices_are_sorted=True)
  max_PKGT = jnp.moveaxis(jnp.max(old_KPGTS, axis=-1), 1, 0)
  max_BKGT = jnp.maximum(segment(max_PKGT, jax.ops.segment_max), jnp.max(new_BKGTS, axis=-1))
  max_BKGT = jnp.where(jnp.isfinite(max_BKGT), max_BKGT, 0.0)  # rows that see nothing
  old_KPGTS = jnp.exp(old_KPGTS - jnp.moveaxis(max_BKGT[pages.row_P], 0, 1)[..., None])
  new_BKGTS = jnp.exp(new_BKGTS - max_BKGT[..., None])
  sum_BKGT = (segment(jnp.moveaxis(jnp.sum(old_KPGTS, axis=-1), 1, 0), jax.ops.segment_sum)
              + jnp.sum(new_BKGTS, axis=-1))
  # per-entry partial sums stay float32 until the division (one rounding, as in attention())
  out_PKGTH = jnp.einsum("KPGTS,KPSH->PKGTH", old_KPGTS.astype(dtype), v_KPSH,
                         preferred_element_type=jnp.float32)
  out_BKGTH = (segment(out_PKGTH, jax.ops.segment_sum)
               + jnp.einsum("BKGTS,BSKH->BKGTH", new_BKGTS.astype(dtype), v_BTKH.astype(dtype),
                            preferred_element_type=jnp.float32))
  out_BKGTH = out_BKGTH / jnp.where(sum_BKGT > 0, sum_BKGT, 1.0)[..., None]
  return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(b, t, n, -1).astype(dtype)
