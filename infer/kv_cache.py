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

A float cache of more than one row is read in place: each layer attends over
its slice of the cache with the chunk written into that slice's copy, hands
the chunk's keys and values out of the layer scan, and they are written into
the (donated) cache once after it. A `width` cuts that slice to the slots a
batch holds (the engine passes the power of two above its longest row), so an
early step does not pay for the whole context. Returning each layer's updated slice
instead (as one-row and int8 caches do) makes the scan copy the whole cache
every step. When the layers run unrolled (models/layer_weights.py), each layer
writes its chunk into a float cache itself, one-row caches included (an int8
cache hands each layer's updated slice out, as under the scan).

`kv_dtype="int8"` stores keys and values as int8 with a float32 scale per
(token, kv head), symmetric absmax/127 over H: quantized as they are written,
dequantized per layer inside the jitted step just before attention, so the
cache holds (1 + 4/H)/4 of the float32 bytes. The scales ride along in
`k_scale_LBSK`/`v_scale_LBSK` (None for a float cache).

A prefix-LM (arch="prefix_lm") cache also marks in `prefix_BS` the slots of
the first chunk each row receives, its prompt: those keys are visible to every
query of the prompt, as in training, and generation after them is causal.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.attention import attention
from models.config import ModelConfig
from models.layer_weights import is_unrolled
import parallel
from parallel import constrain

KV_AXES = ("layers", "act_batch", "act_seq", "act_kv_heads", None)
SCALE_AXES = KV_AXES[:-1]
SLOT_AXES = ("act_batch", "act_seq")
MIN_BUCKET = 16
# Packed prefill's blockwise tiles: key/value tiles of this many tokens, so that the kernel
# skips the many tiles in which no query sees a key (those lying wholly across two prompts).
# SmolLM2-135M, 8 prompts packed into 384 tokens, on CPU: 0.86x the time of the naive
# kernel's one masked [384, 384] score matrix (benchmarks/decode_split.py --parts tiles).
PACKED_TILE = 32
KV_DTYPES = (None, "int8")  # None: the model's compute dtype


class KVCache(NamedTuple):
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  segment_ids_BS: jax.Array  # int32; 0 = empty slot
  positions_BS: jax.Array    # int32 position of the token in each slot
  lengths_B: jax.Array       # int32; tokens held per row = the next slot to write
  k_scale_LBSK: jax.Array | None = None  # float32 int8 steps; None: k, v are float
  v_scale_LBSK: jax.Array | None = None
  prefix_BS: jax.Array | None = None     # int32 1: a prompt slot of a prefix-LM

  @property
  def max_len(self) -> int:
    return self.segment_ids_BS.shape[1]

  @property
  def layers(self) -> tuple:
    """What model.decode scans over: (k, v), or (k, v, k_scale, v_scale) for int8."""
    scales = () if self.k_scale_LBSK is None else (self.k_scale_LBSK, self.v_scale_LBSK)
    return (self.k_LBSKH, self.v_LBSKH) + scales


def check_kv_dtype(kv_dtype) -> None:
  if not (kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES)):
    raise ValueError(f"kv_dtype={kv_dtype!r} is not supported: use None (the model's compute "
                     "dtype) or 'int8'")


def constrain_cache(cache: KVCache) -> KVCache:
  """Pins the cache's sharding by logical names (a no-op outside a mesh)."""
  slots = lambda a: constrain(a, SLOT_AXES[:a.ndim])
  scale = lambda a: None if a is None else constrain(a, SCALE_AXES)
  prefix = None if cache.prefix_BS is None else slots(cache.prefix_BS)
  return KVCache(constrain(cache.k_LBSKH, KV_AXES), constrain(cache.v_LBSKH, KV_AXES),
                 slots(cache.segment_ids_BS), slots(cache.positions_BS), slots(cache.lengths_B),
                 scale(cache.k_scale_LBSK), scale(cache.v_scale_LBSK), prefix)


def init(cfg: ModelConfig, batch: int, max_len: int, kv_dtype: str | None = None) -> KVCache:
  """An empty cache of `max_len` slots per row: the model's compute dtype, or int8 + scales."""
  check_kv_dtype(kv_dtype)
  shape = (cfg.decoder_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  zeros_BS = jnp.zeros((batch, max_len), jnp.int32)
  dtype = jnp.int8 if kv_dtype == "int8" else cfg.jnp_dtype
  scales = (jnp.zeros(shape[:-1], jnp.float32),) * 2 if kv_dtype == "int8" else (None, None)
  prefix = zeros_BS if cfg.arch == "prefix_lm" else None
  return constrain_cache(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), zeros_BS,
                                 zeros_BS, jnp.zeros((batch,), jnp.int32), *scales, prefix))


def head_bytes(cfg: ModelConfig, kv_dtype: str | None = None) -> int:
  """Bytes of one token's key (or value) in one layer and kv head, its int8 scale included."""
  check_kv_dtype(kv_dtype)
  if kv_dtype == "int8":
    return cfg.head_dim + 4
  return cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, kv_dtype: str | None = None) -> int:
  """Bytes of keys and values (and int8 scales) in a cache of `batch` rows of `max_len` slots."""
  return 2 * cfg.decoder_layers * batch * max_len * cfg.num_kv_heads * head_bytes(cfg, kv_dtype)


def quantize(x_H):
  """(int8 x_H, float32 scale): symmetric absmax/127 over the last axis, so each element is
  off by at most scale/2; an all-zero vector gets scale 0."""
  x32_H = x_H.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32_H), axis=-1) / 127
  safe = jnp.where(scale > 0, scale, 1)[..., None]  # zeros quantize to 0, not NaN
  return jnp.clip(jnp.round(x32_H / safe), -127, 127).astype(jnp.int8), scale


def dequantize(q_H, scale, dtype):
  """q_H · scale in `dtype` (multiplied in float32: a bfloat16 scale would cost precision)."""
  return (q_H.astype(jnp.float32) * scale[..., None]).astype(dtype)


def write_rows(buf_BS, new_BT, index_B):
  """buf_BS with row b's new_BT at slots [index_B[b], index_B[b] + T) (any trailing dims)."""
  write = lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, axis=0)
  return jax.vmap(write)(buf_BS, new_BT, index_B)


def write_layers(buf_LBSKH, new_LBTKH, slots_BT, layer=None):
  """buf_LBSKH with every layer's chunk at row b's slots slots_BT[b] (the scan's outputs into
  the donated cache), or with `layer` that layer's chunk alone (then new_LBTKH is new_BTKH).
  The caller keeps the slots < S (see `forward`); one past it is dropped."""
  rows_BT = jnp.broadcast_to(jnp.arange(slots_BT.shape[0])[:, None], slots_BT.shape)
  layers = slice(None) if layer is None else layer
  return buf_LBSKH.at[layers, rows_BT, slots_BT].set(new_LBTKH.astype(buf_LBSKH.dtype),
                                                     unique_indices=True, mode="drop")


@dataclasses.dataclass(frozen=True)
class _Slots:
  """What Attention.decode calls per layer: write the chunk at index_B, attend over the slots."""
  segment_ids_BS: jax.Array
  positions_BS: jax.Array
  index_B: jax.Array
  prefix_BS: jax.Array | None = None
  cache: KVCache | None = None  # set: a float cache read in place, layer_cache is the layer
  width: int | None = None  # in place: attend over slots [0, width) only

  def attend(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None):
    """`bias_fn`: a relative position bias (T5), computed from the query and slot positions."""
    if self.cache is None and len(layer_cache) == 4:  # (k, v, k_scale, v_scale): int8
      return self._attend_int8(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                               segment_ids_BT, cfg, bias_fn)
    if self.cache is not None:  # layer_cache is the layer: read its slice of the cache
      w = self.width or self.cache.max_len
      layer_cache = (self.cache.k_LBSKH[layer_cache, :, :w],
                     self.cache.v_LBSKH[layer_cache, :, :w])
    k_BSKH, v_BSKH = layer_cache
    names = KV_AXES[1:]
    k_BSKH = constrain(write_rows(k_BSKH, k_BTKH.astype(k_BSKH.dtype), self.index_B), names)
    v_BSKH = constrain(write_rows(v_BSKH, v_BTKH.astype(v_BSKH.dtype), self.index_B), names)
    out_BTNH = self.slot_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT, cfg,
                                   bias_fn)
    # In place only the chunk leaves the scan; otherwise the layer's whole updated slice.
    return out_BTNH, ((k_BTKH, v_BTKH) if self.cache is not None else (k_BSKH, v_BSKH))

  def _attend_int8(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
                   bias_fn=None):
    """Writes the chunk quantized; attends over this layer's slots dequantized (never stored)."""
    k_BSKH, v_BSKH, k_scale_BSK, v_scale_BSK = layer_cache
    kq_BTKH, k_scale_BTK = quantize(k_BTKH)
    vq_BTKH, v_scale_BTK = quantize(v_BTKH)
    write = lambda buf, new, names: constrain(write_rows(buf, new, self.index_B), names)
    k_BSKH, v_BSKH = write(k_BSKH, kq_BTKH, KV_AXES[1:]), write(v_BSKH, vq_BTKH, KV_AXES[1:])
    k_scale_BSK = write(k_scale_BSK, k_scale_BTK, SCALE_AXES[1:])
    v_scale_BSK = write(v_scale_BSK, v_scale_BTK, SCALE_AXES[1:])
    out_BTNH = self.slot_attention(q_BTNH, dequantize(k_BSKH, k_scale_BSK, q_BTNH.dtype),
                                   dequantize(v_BSKH, v_scale_BSK, q_BTNH.dtype), positions_BT,
                                   segment_ids_BT, cfg, bias_fn)
    return out_BTNH, (k_BSKH, v_BSKH, k_scale_BSK, v_scale_BSK)

  def slot_attention(self, q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT, cfg, bias_fn):
    """Causal attention of the chunk over k_BSKH/v_BSKH, slots already holding the chunk:
    their segment ids, positions and prefix marks are these slots' own."""
    s = k_BSKH.shape[1]  # the slots read: all, or the first `width`
    prefix_BS = None if self.prefix_BS is None else self.prefix_BS[:, :s]
    return attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                     kv_segment_ids_BS=self.segment_ids_BS[:, :s], q_positions_BT=positions_BT,
                     kv_positions_BS=self.positions_BS[:, :s], causal=True,
                     sliding_window=cfg.sliding_window or None, impl=cfg.attention_impl,
                     scale=cfg.scale, bias_fn=bias_fn, kv_prefix_BS=prefix_BS)


def forward(model, tokens_BT, segment_ids_BT, cache: KVCache, *, all_logits=False, width=None):
  """Appends a chunk to every row: (logits, cache).

  logits_BV at each row's last real token, or with `all_logits` logits_BTV
  at every chunk position. `segment_ids_BT` is 1 for real tokens, 0 for
  padding, and a row's padding comes after its real tokens; a row with none (a
  finished request) leaves its cache as it was, bar an empty slot. The caller
  keeps lengths + T <= S, and with `width` (a static int) lengths + T <= width: a cache read
  in place then attends over slots [0, width) only, so a step's attention costs what the
  batch holds, not what the cache could (an int8 cache ignores it, and so does a one-row cache
  unless the layers run unrolled).
  """
  t = tokens_BT.shape[1]
  real_BT = (segment_ids_BT > 0).astype(jnp.int32)
  n_B = jnp.sum(real_BT, axis=1)
  index_B = cache.lengths_B
  positions_BT = index_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  prefix_BS = None
  if cache.prefix_BS is not None:
    # A row's first chunk is its prompt, the prefix-LM's bidirectional part.
    first_BT = real_BT * (index_B == 0).astype(jnp.int32)[:, None]
    prefix_BS = write_rows(cache.prefix_BS, first_BT, index_B)
  # Measured on XLA:CPU: in place wins from batch 2 up (SmolLM2, batch 8: +60% tokens/s) but
  # costs a one-row step ~0.6 ms of fixed overhead, which a small model's step notices.
  int8 = cache.k_scale_LBSK is not None
  unrolled = is_unrolled(model)
  in_place = reads_in_place(cache.k_LBSKH.shape[1], int8, unrolled)
  slots = _Slots(write_rows(cache.segment_ids_BS, real_BT, index_B),
                 write_rows(cache.positions_BS, positions_BT, index_B), index_B, prefix_BS,
                 cache if in_place else None, width if in_place else None)
  layers = jnp.arange(cache.k_LBSKH.shape[0]) if in_place else cache.layers
  last_B = None if all_logits else jnp.maximum(n_B - 1, 0)
  if in_place and unrolled:  # each layer writes its chunk into the cache itself
    writes = _LayerWrites(slots, cache.k_LBSKH, cache.v_LBSKH)
    logits, _ = model.decode(tokens_BT, positions_BT, real_BT, layers, writes, last_B)
    k, v, scales = writes.k_LBSKH, writes.v_LBSKH, None
  else:
    # k, v: the updated cache (k_LBSKH), or in place only the chunk's keys and values (k_LBTKH)
    logits, (k, v, *scales) = model.decode(tokens_BT, positions_BT, real_BT, layers, slots,
                                           last_B)
  if in_place and not unrolled:
    # a real token's slot is its position
    k, v = (write_layers(cache.k_LBSKH, k, positions_BT),
            write_layers(cache.v_LBSKH, v, positions_BT))
  scales = scales or [None, None]
  return logits, constrain_cache(KVCache(k, v, slots.segment_ids_BS,
                                         slots.positions_BS, index_B + n_B, *scales, prefix_BS))


class _LayerWrites:
  """What Attention.decode calls per layer when the layers run unrolled
  (models/layer_weights.py): writes the chunk into layer `layer` of the donated cache, then
  attends over that layer's slots. Each write is ordered after the previous layer's read by
  the data flow, so XLA updates the cache in place; the scan form instead hands the chunks
  out and writes them after the last layer (a scan body cannot update a buffer it reads)."""

  def __init__(self, slots: "_Slots", k_LBSKH, v_LBSKH):
    self.slots, self.k_LBSKH, self.v_LBSKH = slots, k_LBSKH, v_LBSKH

  def attend(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None):
    # a real token's slot is its position (see `forward`)
    self.k_LBSKH = write_layers(self.k_LBSKH, k_BTKH, positions_BT, layer)
    self.v_LBSKH = write_layers(self.v_LBSKH, v_BTKH, positions_BT, layer)
    w = self.slots.width or self.k_LBSKH.shape[2]
    k_BSKH = constrain(self.k_LBSKH[layer, :, :w], KV_AXES[1:])
    v_BSKH = constrain(self.v_LBSKH[layer, :, :w], KV_AXES[1:])
    out_BTNH = self.slots.slot_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT,
                                         cfg, bias_fn)
    return out_BTNH, None


class _Packed:
  """What Attention.decode calls per layer at a packed prefill: causal attention within each
  prompt (segment), handing the keys and values out of the layer scan."""

  def attend(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None):
    impl, tile = cfg.attention_impl, {}
    # "auto" on CPU: tiles (measured). On GPU/TPU "auto" keeps its own choice, unmeasured
    # here; a position bias runs on the naive kernel whatever is asked.
    if bias_fn is None and (impl == "blockwise" or (
        impl == "auto" and parallel.platform() not in ("gpu", "tpu"))):
      impl, tile = "blockwise", dict(block_q=PACKED_TILE, block_kv=PACKED_TILE)
    out_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, q_segment_ids_BT=segment_ids_BT,
                         kv_segment_ids_BS=segment_ids_BT, q_positions_BT=positions_BT,
                         kv_positions_BS=positions_BT, causal=True,
                         sliding_window=cfg.sliding_window or None, impl=impl,
                         scale=cfg.scale, bias_fn=bias_fn, **tile)
    return out_BTNH, (k_BTKH, v_BTKH)


def prefill_packed(model, tokens_1P, segment_ids_1P, positions_1P, row_P, last_B,
                   cache: KVCache):
  """Prompts packed into one row: (logits_BV at each row's last prompt token, cache).

  Prompt b's tokens carry segment id b + 1 and positions 0.. in tokens_1P; row_P[p] is the
  cache row of packed token p (>= B for padding: dropped) and last_B[b] the packed index of
  row b's last token. The rows of `cache` must be empty. Padding a batch of prompts to its
  longest costs prefill time in proportion; packing pads the sum once.
  """
  if model.cfg.arch != "decoder":
    raise ValueError(f"packed prefill is for arch='decoder' (got {model.cfg.arch!r}): a "
                     "prefix-LM marks each row's prompt in its cache")
  if cache.k_scale_LBSK is not None:
    raise ValueError("packed prefill fills a float cache: an int8 cache's prefill attends over "
                     "its quantized keys (forward), as its decode steps do")
  layers = jnp.arange(cache.k_LBSKH.shape[0])
  logits_BV, (k_L1PKH, v_L1PKH) = model.decode(tokens_1P, positions_1P, segment_ids_1P, layers,
                                               _Packed(), last_B)
  pos_P = positions_1P[0]
  put = lambda buf, new: buf.at[:, row_P, pos_P].set(new.astype(buf.dtype), mode="drop")
  k, v = k_L1PKH[:, 0], v_L1PKH[:, 0]
  real_P = (segment_ids_1P[0] > 0).astype(jnp.int32)
  slots = lambda buf, new: buf.at[row_P, pos_P].set(new, mode="drop")
  lengths_B = jnp.zeros_like(cache.lengths_B).at[row_P].add(real_P, mode="drop")
  cache = cache._replace(k_LBSKH=put(cache.k_LBSKH, k), v_LBSKH=put(cache.v_LBSKH, v),
                         segment_ids_BS=slots(cache.segment_ids_BS, real_P),
                         positions_BS=slots(cache.positions_BS, pos_P), lengths_B=lengths_B)
  return logits_BV, constrain_cache(cache)


def truncate(cache: KVCache, lengths_B) -> KVCache:
  """The cache with row b cut back to its first lengths_B[b] tokens (rejected drafts dropped)."""
  keep_BS = jnp.arange(cache.max_len)[None, :] < lengths_B[:, None]
  return cache._replace(segment_ids_BS=jnp.where(keep_BS, cache.segment_ids_BS, 0),
                        lengths_B=lengths_B.astype(jnp.int32))


def bucket(n: int, limit: int, minimum: int = MIN_BUCKET) -> int:
  """The padded length for n tokens, at most `limit`: `minimum` up to it, then the next
  multiple of an eighth of the power of two above n (17..32 -> 20, 24, 28, 32; 65..128 -> 80,
  96, 112, 128). Padding stays under 25% for four compilations per doubling; powers of two
  padded a 65-token prompt to 128, and prefill's time grows with the padded length."""
  if n > limit:
    raise ValueError(f"{n} tokens do not fit in a cache of {limit} slots")
  if n <= minimum:
    return min(minimum, limit)
  step = max((1 << (n - 1).bit_length()) // 8, 1)
  return min(-(-n // step) * step, limit)


def reads_in_place(rows: int, int8: bool, unrolled: bool = False) -> bool:
  """Whether `forward` reads a cache of `rows` rows in place (module docstring), and so
  honours its `width`: a float cache of more than one row, or of any rows when the layers
  run unrolled (models/layer_weights.py), whose layers each write into the cache itself."""
  return not int8 and (rows > 1 or unrolled)


def width_for(n: int, limit: int, minimum: int = MIN_BUCKET) -> int:
  """The slots a decode step reads when a row holds up to n tokens: the next power of two
  >= max(n, minimum), at most `limit` (few widths, so few compilations)."""
  return min(max(minimum, 1 << (n - 1).bit_length()), limit)
