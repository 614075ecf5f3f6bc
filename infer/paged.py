"""A paged key/value cache: one pool of fixed-size pages shared by all sequences (vLLM style).

The pool holds k and v as [L, K, W, Z, H]: W pages of Z token slots per layer
and kv head (the layout of JAX's Pallas paged-attention kernel). Page 0 is
the null page: never handed out, it absorbs the writes of padding tokens and
fills unused block-table entries. A sequence's block table (row of
`table_BY`) lists its pages in order, so its token at position p lives in
slot p % Z of page table[p // Z]; `start_B` says how many of its tokens are
already cached. Which pages a sequence owns is decided on the host by
infer/block_manager.py; this module only moves keys and values.

Attention gathers each row's pages through its block table into a contiguous
[B, Y·Z, K, H] view and calls the shared `models.attention.attention`, so the
paged and contiguous caches compute the same thing. On TPU a one-token
decode step goes to the Pallas paged-attention kernel instead, which reads
the pages in place.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.attention import attention
from models.config import ModelConfig
from parallel import constrain

POOL_AXES = ("layers", "act_kv_heads", None, None, None)
NULL_PAGE = 0


class PagePool(NamedTuple):
  k_LKWZH: jax.Array
  v_LKWZH: jax.Array

  @property
  def page_size(self) -> int:
    return self.k_LKWZH.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k_LKWZH.shape[2]


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int) -> PagePool:
  """A zeroed pool of `num_pages` pages (page 0 included) in the model's compute dtype."""
  shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  zeros = lambda: constrain(jnp.zeros(shape, cfg.jnp_dtype), POOL_AXES)
  return PagePool(zeros(), zeros())


def page_bytes(cfg: ModelConfig, page_size: int) -> int:
  """Bytes one page takes across all layers, keys and values."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(
      cfg.jnp_dtype).itemsize


def gather_pages(pages_KWZH, table_BY):
  """Row b's pages, in block-table order, as one contiguous [B, Y·Z, K, H] sequence."""
  k, _, z, h = pages_KWZH.shape
  b, y = table_BY.shape
  x_KBYZH = pages_KWZH[:, table_BY]
  return jnp.transpose(x_KBYZH, (1, 2, 3, 0, 4)).reshape(b, y * z, k, h)


def scatter_tokens(pages_KWZH, new_BTKH, page_BT, slot_BT):
  """pages with token (b, t) written at slot slot_BT[b, t] of page page_BT[b, t]."""
  return pages_KWZH.at[:, page_BT, slot_BT].set(
      jnp.transpose(new_BTKH, (2, 0, 1, 3)).astype(pages_KWZH.dtype))


@dataclasses.dataclass(frozen=True)
class _Pages:
  """What Attention.decode calls per layer: scatter the chunk into pages, attend through tables."""
  table_BY: jax.Array
  page_BT: jax.Array
  slot_BT: jax.Array
  lengths_B: jax.Array  # tokens cached per row once this chunk is written

  def attend(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg):
    k_KWZH, v_KWZH = layer_cache
    k_KWZH = scatter_tokens(k_KWZH, k_BTKH, self.page_BT, self.slot_BT)
    v_KWZH = scatter_tokens(v_KWZH, v_BTKH, self.page_BT, self.slot_BT)
    if _pallas_decode_ok(q_BTNH, cfg):
      out_BTNH = _pallas_decode(q_BTNH, k_KWZH, v_KWZH, self.lengths_B, self.table_BY)
    else:
      out_BTNH = paged_attention(q_BTNH, k_KWZH, v_KWZH, self.table_BY, self.lengths_B,
                                 positions_BT, segment_ids_BT, cfg)
    return out_BTNH, (k_KWZH, v_KWZH)


def paged_attention(q_BTNH, k_KWZH, v_KWZH, table_BY, lengths_B, positions_BT, segment_ids_BT,
                    cfg: ModelConfig):
  """The pure-JAX reference: gather through the block tables, then the shared attention()."""
  k_BSKH, v_BSKH = gather_pages(k_KWZH, table_BY), gather_pages(v_KWZH, table_BY)
  s = k_BSKH.shape[1]
  kv_positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q_BTNH.shape[0], s))
  kv_segment_ids_BS = (kv_positions_BS < lengths_B[:, None]).astype(jnp.int32)
  return attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                   kv_segment_ids_BS=kv_segment_ids_BS, q_positions_BT=positions_BT,
                   kv_positions_BS=kv_positions_BS, causal=True,
                   sliding_window=cfg.sliding_window or None, impl=cfg.attention_impl)


def _pallas_decode_ok(q_BTNH, cfg: ModelConfig) -> bool:
  # The kernel serves one query per row with a full causal prefix: no windows, TPU only.
  return (q_BTNH.shape[1] == 1 and not cfg.sliding_window and jax.default_backend() == "tpu"
          and cfg.attention_impl in ("auto", "pallas"))


def _pallas_decode(q_BTNH, k_KWZH, v_KWZH, lengths_B, table_BY):
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

  scale = q_BTNH.shape[-1] ** -0.5  # the kernel does not scale the scores itself
  out_BNH = kernel((q_BTNH[:, 0] * scale).astype(k_KWZH.dtype), k_KWZH, v_KWZH, lengths_B,
                   table_BY,
                   # the kernel wants a width it divides; widths are powers of two or max_blocks
                   pages_per_compute_block=math.gcd(table_BY.shape[1], 8))
  return out_BNH[:, None].astype(q_BTNH.dtype)


def forward(model, pool: PagePool, tokens_BT, segment_ids_BT, start_B, table_BY, *,
            all_logits=False):
  """Appends a right-padded chunk to each row's pages: (logits, pool).

  Row b's chunk holds positions start_B[b].. of its sequence, its real tokens
  first (segment id 1) then padding (0). Returns logits_BV at each row's last
  real token (all_logits: logits_BTV). Rows with no real tokens are padding
  rows (their table may be all null pages).
  """
  t = tokens_BT.shape[1]
  z = pool.page_size
  real_BT = (segment_ids_BT > 0).astype(jnp.int32)
  n_B = jnp.sum(real_BT, axis=1)
  positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  block_BT = jnp.minimum(positions_BT // z, table_BY.shape[1] - 1)
  page_BT = jnp.where(real_BT > 0, jnp.take_along_axis(table_BY, block_BT, axis=1), NULL_PAGE)
  pages = _Pages(table_BY, page_BT, positions_BT % z, start_B + n_B)
  logits, (k_LKWZH, v_LKWZH) = model.decode(
      tokens_BT, positions_BT, real_BT, (pool.k_LKWZH, pool.v_LKWZH), pages,
      None if all_logits else jnp.maximum(n_B - 1, 0))
  return logits, PagePool(constrain(k_LKWZH, POOL_AXES), constrain(v_LKWZH, POOL_AXES))

