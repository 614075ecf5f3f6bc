"""A preallocated, contiguous key/value cache: one [L, B, S, K, H] buffer each for k and v.

Row b's tokens fill slots [0, lengths_B[b]) in order, so a real token's slot
is its position (every row starts at position 0). Each slot carries a segment
id (1: a real token; 0: empty or padding, never attended) and its position;
attention is causal by position. A chunk of T new tokens per row (a
right-padded prompt at prefill, one token per decode step) is written at the
row's next slots; only its real tokens advance `lengths_B`, so the padding a
chunk writes is overwritten by the row's next tokens.

Shapes are static for jit: S is fixed per engine (its max_seq_len) and prompt
chunks are bucketed (`bucket`), so a few compilations serve every request.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.attention import attention
from models.config import ModelConfig
from parallel import constrain

KV_AXES = ("layers", "act_batch", "act_seq", "act_kv_heads", None)
SLOT_AXES = ("act_batch", "act_seq")
MIN_BUCKET = 16


class KVCache(NamedTuple):
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  segment_ids_BS: jax.Array  # int32; 0 = empty slot
  positions_BS: jax.Array    # int32 position of the token in each slot
  lengths_B: jax.Array       # int32; tokens held per row = the next slot to write

  @property
  def max_len(self) -> int:
    return self.segment_ids_BS.shape[1]


def constrain_cache(cache: KVCache) -> KVCache:
  """Pins the cache's sharding by logical names (a no-op outside a mesh)."""
  slots = lambda a: constrain(a, SLOT_AXES[:a.ndim])
  return KVCache(constrain(cache.k_LBSKH, KV_AXES), constrain(cache.v_LBSKH, KV_AXES),
                 slots(cache.segment_ids_BS), slots(cache.positions_BS), slots(cache.lengths_B))


def init(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
  """An empty cache of `max_len` slots per row, in the model's compute dtype."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  zeros_BS = jnp.zeros((batch, max_len), jnp.int32)
  return constrain_cache(KVCache(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype),
                                 zeros_BS, zeros_BS, jnp.zeros((batch,), jnp.int32)))


def write_rows(buf_BS, new_BT, index_B):
  """buf_BS with row b's new_BT at slots [index_B[b], index_B[b] + T) (any trailing dims)."""
  write = lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, axis=0)
  return jax.vmap(write)(buf_BS, new_BT, index_B)


@dataclasses.dataclass(frozen=True)
class _Slots:
  """What Attention.decode calls per layer: write the chunk at index_B, attend over the slots."""
  segment_ids_BS: jax.Array
  positions_BS: jax.Array
  index_B: jax.Array

  def attend(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg):
    k_BSKH, v_BSKH = layer_cache
    names = KV_AXES[1:]
    k_BSKH = constrain(write_rows(k_BSKH, k_BTKH.astype(k_BSKH.dtype), self.index_B), names)
    v_BSKH = constrain(write_rows(v_BSKH, v_BTKH.astype(v_BSKH.dtype), self.index_B), names)
    out_BTNH = attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                         kv_segment_ids_BS=self.segment_ids_BS, q_positions_BT=positions_BT,
                         kv_positions_BS=self.positions_BS, causal=True,
                         sliding_window=cfg.sliding_window or None, impl=cfg.attention_impl)
    return out_BTNH, (k_BSKH, v_BSKH)


def forward(model, tokens_BT, segment_ids_BT, cache: KVCache, *, all_logits=False):
  """Appends a chunk to every row: (logits, cache).

  logits_BV at each row's last real token, or with `all_logits` logits_BTV
  at every chunk position. `segment_ids_BT` is 1 for real tokens, 0 for
  padding, and a row's padding comes after its real tokens; a row with none (a
  finished request) leaves its cache as it was, bar an empty slot. The caller
  keeps lengths + T <= S.
  """
  t = tokens_BT.shape[1]
  real_BT = (segment_ids_BT > 0).astype(jnp.int32)
  n_B = jnp.sum(real_BT, axis=1)
  index_B = cache.lengths_B
  positions_BT = index_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  slots = _Slots(write_rows(cache.segment_ids_BS, real_BT, index_B),
                 write_rows(cache.positions_BS, positions_BT, index_B), index_B)
  logits, (k_LBSKH, v_LBSKH) = model.decode(
      tokens_BT, positions_BT, real_BT, (cache.k_LBSKH, cache.v_LBSKH), slots,
      None if all_logits else jnp.maximum(n_B - 1, 0))
  return logits, constrain_cache(KVCache(k_LBSKH, v_LBSKH, slots.segment_ids_BS,
                                         slots.positions_BS, index_B + n_B))


def truncate(cache: KVCache, lengths_B) -> KVCache:
  """The cache with row b cut back to its first lengths_B[b] tokens (rejected drafts dropped)."""
  keep_BS = jnp.arange(cache.max_len)[None, :] < lengths_B[:, None]
  return cache._replace(segment_ids_BS=jnp.where(keep_BS, cache.segment_ids_BS, 0),
                        lengths_B=lengths_B.astype(jnp.int32))


def bucket(n: int, limit: int, minimum: int = MIN_BUCKET) -> int:
  """The padded length for n tokens: the next power of two >= max(n, minimum), at most `limit`."""
  if n > limit:
    raise ValueError(f"{n} tokens do not fit in a cache of {limit} slots")
  size = minimum
  while size < n:
    size *= 2
  return min(size, limit)
