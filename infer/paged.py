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
the pages in place. PagedEngine's CPU decode steps skip the tables and read a
flat list of the pages in use instead (infer/ragged.py, `forward(ragged=...)`).
A model over per-layer weights (models/layer_weights.py) writes each layer's
chunk into the pool as it goes (`_LayerWrites`), a float pool only.

With `kv_dtype="int8"` the pool holds int8 pages plus float32 scales
[L, K, W, Z] (one per token and kv head, as infer/kv_cache.py): a chunk is
quantized as it is scattered, and only the pages a row's block table names
are dequantized, after the gather. Int8 pools always take the pure-JAX path.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from infer.kv_cache import check_kv_dtype, dequantize, quantize, token_bytes
from infer.ragged import NULL_PAGE, RaggedPages, attend as ragged_attend, pages_of_tokens
from models.attention import attention
from models.config import ModelConfig
from models.layer_weights import is_unrolled
from models.layers import layer_window
import parallel
from parallel import constrain

POOL_AXES = ("layers", "act_kv_heads", None, None, None)
SCALE_AXES = POOL_AXES[:-1]


class PagePool(NamedTuple):
  k_LKWZH: jax.Array
  v_LKWZH: jax.Array
  k_scale_LKWZ: jax.Array | None = None  # float32, int8 pools only
  v_scale_LKWZ: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.k_LKWZH.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k_LKWZH.shape[2]

  @property
  def layers(self) -> tuple:
    """What model.decode scans over: (k, v), or (k, v, k_scale, v_scale) for int8."""
    scales = () if self.k_scale_LKWZ is None else (self.k_scale_LKWZ, self.v_scale_LKWZ)
    return (self.k_LKWZH, self.v_LKWZH) + scales


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int,
              kv_dtype: str | None = None) -> PagePool:
  """A zeroed pool of `num_pages` pages (page 0 included): compute dtype, or int8 + scales."""
  check_kv_dtype(kv_dtype)
  heads, hk, hv = cfg.cache_dims
  shape = (cfg.num_layers, heads, num_pages, page_size)
  dtype = jnp.int8 if kv_dtype == "int8" else cfg.jnp_dtype
  axes = pool_axes(heads)
  zeros = lambda h: constrain(jnp.zeros((*shape, h), dtype), axes)
  scales = lambda: constrain(jnp.zeros(shape, jnp.float32), axes[:-1])
  return PagePool(zeros(hk), zeros(hv), *((scales(), scales()) if kv_dtype == "int8" else ()))


def pool_axes(heads: int) -> tuple:
  """POOL_AXES for a pool of `heads` heads: a latent pool's one head is every device's."""
  return POOL_AXES if heads > 1 else (POOL_AXES[0], None, None, None, None)


def page_bytes(cfg: ModelConfig, page_size: int, kv_dtype: str | None = None) -> int:
  """Bytes one page takes across all layers, keys and values (and int8 scales)."""
  return cfg.num_layers * page_size * token_bytes(cfg, kv_dtype)


def gather_pages(pages_KWZH, table_BY):
  """Row b's pages, in block-table order, as one contiguous [B, Y·Z, K, H] sequence
  (scales: [K, W, Z] pages give [B, Y·Z, K])."""
  k, _, z = pages_KWZH.shape[:3]
  b, y = table_BY.shape
  x_KBYZH = pages_KWZH[:, table_BY]
  return jnp.moveaxis(x_KBYZH, 0, 3).reshape(b, y * z, k, *pages_KWZH.shape[3:])


def scatter_tokens(pages_KWZH, new_BTKH, page_BT, slot_BT):
  """pages with token (b, t) written at slot slot_BT[b, t] of page page_BT[b, t] (scales too)."""
  return pages_KWZH.at[:, page_BT, slot_BT].set(
      jnp.moveaxis(new_BTKH, 2, 0).astype(pages_KWZH.dtype))


def gather_layer(pages_LKWZH, layer, table_BY):
  """gather_pages of one layer, read in place: one gather, no copy of the layer's pages."""
  x_BYKZH = pages_LKWZH[layer, :, table_BY]
  b, y, k, z = x_BYKZH.shape[:4]
  return jnp.swapaxes(x_BYKZH, 2, 3).reshape(b, y * z, k, *x_BYKZH.shape[4:])


@dataclasses.dataclass(frozen=True)
class _Pages:
  """What Attention.decode calls per layer: scatter the chunk into pages, attend through tables.

  With `pool` set (float pools off the TPU kernel) the layer cache is just the layer's index:
  the pool is read in place, the chunk's keys and values are put into the gathered rows only,
  and they leave the layer scan as its outputs, to be written into the pool once afterwards.
  Otherwise each layer returns its whole updated pages, and the scan copies the pool.
  """
  table_BY: jax.Array
  page_BT: jax.Array
  slot_BT: jax.Array
  lengths_B: jax.Array  # tokens cached per row once this chunk is written
  pool: PagePool | None = None
  ragged: RaggedPages | None = None  # attend over these pages (infer/ragged.py), not tables

  def attend(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None, window=None):
    """`window`: the layer's sliding window (models.layers.layer_window; None: cfg's)."""
    window = layer_window(cfg, None) if window is None else window
    if bias_fn is not None:
      raise NotImplementedError("the paged cache has no relative position bias (T5); serve "
                                "encoder-decoder models with infer.seq2seq")
    if self.ragged is not None:
      out_BTNH = ragged_attend(q_BTNH, k_BTKH, v_BTKH, self.pool.k_LKWZH, self.pool.v_LKWZH,
                               layer_cache, self.ragged, positions_BT[:, 0], positions_BT,
                               segment_ids_BT, cfg, window)
      return out_BTNH, (k_BTKH, v_BTKH)
    if self.pool is not None:
      return self._attend_in_place(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                                   segment_ids_BT, cfg, window)
    if len(layer_cache) == 4:  # (k, v, k_scale, v_scale): an int8 pool
      return self._attend_int8(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                               segment_ids_BT, cfg, window)
    k_KWZH, v_KWZH = layer_cache
    k_KWZH = scatter_tokens(k_KWZH, k_BTKH, self.page_BT, self.slot_BT)
    v_KWZH = scatter_tokens(v_KWZH, v_BTKH, self.page_BT, self.slot_BT)
    if _pallas_decode_ok(q_BTNH, cfg):
      out_BTNH = _pallas_decode(q_BTNH, k_KWZH, v_KWZH, self.lengths_B, self.table_BY,
                                cfg.scale)
    else:
      out_BTNH = paged_attention(q_BTNH, k_KWZH, v_KWZH, self.table_BY, self.lengths_B,
                                 positions_BT, segment_ids_BT, cfg, window)
    return out_BTNH, (k_KWZH, v_KWZH)

  def _attend_in_place(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
                       window):
    pool = self.pool
    k_BSKH = gather_layer(pool.k_LKWZH, layer, self.table_BY)
    v_BSKH = gather_layer(pool.v_LKWZH, layer, self.table_BY)
    b, s = k_BSKH.shape[:2]
    # slot s of a gathered row is position s; padding tokens go nowhere
    at_BT = jnp.where(segment_ids_BT > 0, positions_BT, s)
    rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], at_BT.shape)
    k_BSKH = k_BSKH.at[rows_BT, at_BT].set(k_BTKH.astype(k_BSKH.dtype), mode="drop")
    v_BSKH = v_BSKH.at[rows_BT, at_BT].set(v_BTKH.astype(v_BSKH.dtype), mode="drop")
    out_BTNH = attend_gathered(q_BTNH, k_BSKH, v_BSKH, self.lengths_B, positions_BT,
                               segment_ids_BT, cfg, window)
    return out_BTNH, (k_BTKH, v_BTKH)

  def _attend_int8(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
                   window):
    """Scatters the chunk quantized; dequantizes only the pages the rows' block tables name."""
    k_KWZH, v_KWZH, k_scale_KWZ, v_scale_KWZ = layer_cache
    scatter = lambda pages, new: scatter_tokens(pages, new, self.page_BT, self.slot_BT)
    kq_BTKH, k_scale_BTK = quantize(k_BTKH)
    vq_BTKH, v_scale_BTK = quantize(v_BTKH)
    k_KWZH, k_scale_KWZ = scatter(k_KWZH, kq_BTKH), scatter(k_scale_KWZ, k_scale_BTK)
    v_KWZH, v_scale_KWZ = scatter(v_KWZH, vq_BTKH), scatter(v_scale_KWZ, v_scale_BTK)
    gather = lambda q_KWZH, scale_KWZ: dequantize(gather_pages(q_KWZH, self.table_BY),
                                                  gather_pages(scale_KWZ, self.table_BY),
                                                  q_BTNH.dtype)
    out_BTNH = attend_gathered(q_BTNH, gather(k_KWZH, k_scale_KWZ), gather(v_KWZH, v_scale_KWZ),
                               self.lengths_B, positions_BT, segment_ids_BT, cfg, window)
    return out_BTNH, (k_KWZH, v_KWZH, k_scale_KWZ, v_scale_KWZ)


class _LayerWrites:
  """What Attention.decode calls per layer when the layers run unrolled
  (models/layer_weights.py): writes the chunk into layer `layer`'s pages of the donated pool,
  then attends as `_Pages` does in place. As in infer/kv_cache.py, the data flow orders each
  write after the previous layer's read, so XLA updates the pool in place instead of the scan
  form's one write of every layer's chunks after the last layer."""

  def __init__(self, pages: _Pages):
    self.pages, self.k_LKWZH, self.v_LKWZH = pages, pages.pool.k_LKWZH, pages.pool.v_LKWZH

  def attend(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None, window=None):
    p = self.pages
    # the scalar layer and the [B, T] page and slot indices broadcast to [B, T], leading
    write = lambda pages_LKWZH, new_BTKH: pages_LKWZH.at[layer, :, p.page_BT, p.slot_BT].set(
        new_BTKH.astype(pages_LKWZH.dtype))
    self.k_LKWZH, self.v_LKWZH = write(self.k_LKWZH, k_BTKH), write(self.v_LKWZH, v_BTKH)
    # the chunk's slots now hold it too: the ragged path masks them and takes k_BTKH, the
    # tables' path writes the same values into its gathered rows again
    pages = dataclasses.replace(p, pool=PagePool(self.k_LKWZH, self.v_LKWZH))
    out_BTNH, _ = pages.attend(layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
                               bias_fn, window)
    return out_BTNH, None


def paged_attention(q_BTNH, k_KWZH, v_KWZH, table_BY, lengths_B, positions_BT, segment_ids_BT,
                    cfg: ModelConfig, window=None):
  """The pure-JAX reference: gather through the block tables, then the shared attention()."""
  return attend_gathered(q_BTNH, gather_pages(k_KWZH, table_BY), gather_pages(v_KWZH, table_BY),
                         lengths_B, positions_BT, segment_ids_BT, cfg, window)


def attend_gathered(q_BTNH, k_BSKH, v_BSKH, lengths_B, positions_BT, segment_ids_BT,
                    cfg: ModelConfig, window=None):
  """attention() over gathered rows: slot s holds position s, real below lengths_B[b];
  `window`: the layer's (None: cfg's)."""
  window = layer_window(cfg, None) if window is None else window
  s = k_BSKH.shape[1]
  kv_positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q_BTNH.shape[0], s))
  kv_segment_ids_BS = (kv_positions_BS < lengths_B[:, None]).astype(jnp.int32)
  return attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                   kv_segment_ids_BS=kv_segment_ids_BS, q_positions_BT=positions_BT,
                   kv_positions_BS=kv_positions_BS, causal=True,
                   sliding_window=window, impl=cfg.attention_impl, scale=cfg.scale,
                   softcap=cfg.attn_softcap, value_dims=cfg.latent_values)


def _pallas_decode_ok(q_BTNH, cfg: ModelConfig) -> bool:
  return _uses_kernel(q_BTNH.shape[1], cfg)


def _uses_kernel(t: int, cfg: ModelConfig) -> bool:
  # The kernel serves one query per row with a full causal prefix: no windows, TPU only.
  # Mosaic tiles its head dimension by the TPU's 128 lanes: a smaller head fails to lower
  # (seen compiling head_dim 32 for v5e), so it takes the gathered path.
  return (t == 1 and not cfg.sliding_window and not cfg.attn_softcap and not cfg.mla
          and parallel.platform() == "tpu"
          and cfg.head_dim % 128 == 0 and cfg.attention_impl in ("auto", "pallas"))


def _pallas_decode(q_BTNH, k_KWZH, v_KWZH, lengths_B, table_BY, scale):
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

  # the kernel does not scale the scores itself
  out_BNH = kernel((q_BTNH[:, 0] * scale).astype(k_KWZH.dtype), k_KWZH, v_KWZH, lengths_B,
                   table_BY,
                   # the kernel wants a width it divides; widths are powers of two or max_blocks
                   pages_per_compute_block=math.gcd(table_BY.shape[1], 8))
  return out_BNH[:, None].astype(q_BTNH.dtype)


def forward(model, pool: PagePool, tokens_BT, segment_ids_BT, start_B, table_BY, *,
            all_logits=False, in_place: bool | None = None, ragged: RaggedPages | None = None):
  """Appends a right-padded chunk to each row's pages: (logits, pool).

  Row b's chunk holds positions start_B[b].. of its sequence, its real tokens
  first (segment id 1) then padding (0). Returns logits_BV at each row's last
  real token (all_logits: logits_BTV). Rows with no real tokens are padding
  rows (their table may be all null pages). With `ragged` (float pools only),
  attention reads the listed pages (infer/ragged.py) and `table_BY` may be None.
  """
  t = tokens_BT.shape[1]
  z = pool.page_size
  real_BT = (segment_ids_BT > 0).astype(jnp.int32)
  n_B = jnp.sum(real_BT, axis=1)
  positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if ragged is not None:
    page_BT = pages_of_tokens(ragged, positions_BT // z)
  else:
    block_BT = jnp.minimum(positions_BT // z, table_BY.shape[1] - 1)
    page_BT = jnp.take_along_axis(table_BY, block_BT, axis=1)
  page_BT = jnp.where(real_BT > 0, page_BT, NULL_PAGE)
  last_B = None if all_logits else jnp.maximum(n_B - 1, 0)
  slot_BT = positions_BT % z
  if in_place is None:  # the per-layer write only where the TPU kernel or int8 needs it
    in_place = pool.k_scale_LKWZ is None and (ragged is not None or not _uses_kernel(t, model.cfg))
  if in_place and pool.k_scale_LKWZ is not None:
    raise ValueError("an int8 pool is written per layer: in_place=True is for float pools")
  if ragged is not None and not in_place:
    raise ValueError("ragged attention reads a float pool in place: not with in_place=False "
                     "or int8 pages")
  axes = pool_axes(pool.k_LKWZH.shape[1])
  if in_place:
    pages = _Pages(table_BY, page_BT, slot_BT, start_B + n_B, pool, ragged)
    layers = jnp.arange(pool.k_LKWZH.shape[0])
    if is_unrolled(model):  # each layer writes its chunk into the pool itself
      writes = _LayerWrites(pages)
      logits, _ = model.decode(tokens_BT, positions_BT, real_BT, layers, writes, last_B)
      return logits, PagePool(constrain(writes.k_LKWZH, axes), constrain(writes.v_LKWZH, axes))
    logits, (k_LBTKH, v_LBTKH) = model.decode(tokens_BT, positions_BT, real_BT, layers, pages,
                                              last_B)
    write = lambda pages_LKWZH, new_LBTKH: constrain(pages_LKWZH.at[:, :, page_BT, slot_BT].set(
        jnp.moveaxis(new_LBTKH, 3, 1).astype(pages_LKWZH.dtype)), axes)
    return logits, PagePool(write(pool.k_LKWZH, k_LBTKH), write(pool.v_LKWZH, v_LBTKH))
  pages = _Pages(table_BY, page_BT, slot_BT, start_B + n_B)
  logits, (k_LKWZH, v_LKWZH, *scales) = model.decode(
      tokens_BT, positions_BT, real_BT, pool.layers, pages, last_B)
  return logits, PagePool(constrain(k_LKWZH, axes), constrain(v_LKWZH, axes),
                          *(constrain(s, axes[:-1]) for s in scales))

