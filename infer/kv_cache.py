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

A sliding-window decoder (cfg.sliding_window = W) keeps a ring of `ring_slots` = 2W slots
per row when its context is longer (`slots_for`): token p lives in slot p mod S, the
oldest keys are overwritten as new ones arrive, and the mask (by the slots' own positions)
hides what lies outside a query's window. A chunk is written before it is attended, so a
chunk of T tokens needs S >= W + T - 1 to keep every key its queries see: `forward` splits
longer chunks (a long prompt's prefill) into pieces of at most S - W + 1 tokens.

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
from models.layers import layer_window
from parallel import constrain

KV_AXES = ("layers", "act_batch", "act_seq", "act_kv_heads", None)
SCALE_AXES = KV_AXES[:-1]
SLOT_AXES = ("act_batch", "act_seq")
MIN_BUCKET = 16
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


def kv_axes(heads: int) -> tuple:
  """KV_AXES for a cache of `heads` heads: a latent cache's one head is every device's."""
  return KV_AXES if heads > 1 else KV_AXES[:3] + (None, None)


def constrain_cache(cache: KVCache) -> KVCache:
  """Pins the cache's sharding by logical names (a no-op outside a mesh)."""
  slots = lambda a: constrain(a, SLOT_AXES[:a.ndim])
  axes = kv_axes(cache.k_LBSKH.shape[3])
  scale = lambda a: None if a is None else constrain(a, axes[:-1])
  prefix = None if cache.prefix_BS is None else slots(cache.prefix_BS)
  return KVCache(constrain(cache.k_LBSKH, axes), constrain(cache.v_LBSKH, axes),
                 slots(cache.segment_ids_BS), slots(cache.positions_BS), slots(cache.lengths_B),
                 scale(cache.k_scale_LBSK), scale(cache.v_scale_LBSK), prefix)


def ring_slots(cfg: ModelConfig) -> int:
  """Slots of a sliding-window decoder's ring (0: no window): twice the window, so that a
  prefill chunk may be as long as the window plus one (module docstring)."""
  if cfg.arch != "decoder" or "G" in cfg.layer_pattern:  # a global layer sees every position
    return 0
  return 2 * cfg.sliding_window


def slots_for(cfg: ModelConfig, max_len: int) -> int:
  """Slots per row of a cache for `max_len` positions: max_len, or fewer for a sliding window."""
  ring = ring_slots(cfg)
  return min(max_len, ring) if ring else max_len


def init(cfg: ModelConfig, batch: int, max_len: int, kv_dtype: str | None = None) -> KVCache:
  """An empty cache for `max_len` positions per row (`slots_for` slots): the model's compute
  dtype, or int8 + scales."""
  check_kv_dtype(kv_dtype)
  max_len = slots_for(cfg, max_len)
  heads, hk, hv = cfg.cache_dims
  shape = (cfg.decoder_layers, batch, max_len, heads)
  zeros_BS = jnp.zeros((batch, max_len), jnp.int32)
  dtype = jnp.int8 if kv_dtype == "int8" else cfg.jnp_dtype
  scales = (jnp.zeros(shape, jnp.float32),) * 2 if kv_dtype == "int8" else (None, None)
  prefix = zeros_BS if cfg.arch == "prefix_lm" else None
  return constrain_cache(KVCache(jnp.zeros((*shape, hk), dtype), jnp.zeros((*shape, hv), dtype),
                                 zeros_BS, zeros_BS, jnp.zeros((batch,), jnp.int32), *scales,
                                 prefix))


def token_bytes(cfg: ModelConfig, kv_dtype: str | None = None) -> int:
  """Bytes of one token's keys and values in one layer, every cached head and int8 scale
  included (a latent cache: its one latent head, no values)."""
  check_kv_dtype(kv_dtype)
  heads, hk, hv = cfg.cache_dims
  if kv_dtype == "int8":
    return heads * (hk + hv + 8)  # both float32 scales are kept, a latent's (empty) value's too
  return heads * (hk + hv) * jnp.dtype(cfg.jnp_dtype).itemsize


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, kv_dtype: str | None = None) -> int:
  """Bytes of keys and values (and int8 scales) in a cache of `batch` rows for `max_len`
  positions (`slots_for` slots each)."""
  return cfg.decoder_layers * batch * slots_for(cfg, max_len) * token_bytes(cfg, kv_dtype)


def quantize(x_H):
  """(int8 x_H, float32 scale): symmetric absmax/127 over the last axis, so each element is
  off by at most scale/2; an all-zero vector gets scale 0."""
  x32_H = x_H.astype(jnp.float32)
  if not x_H.shape[-1]:  # a latent cache's empty values
    return x_H.astype(jnp.int8), jnp.zeros(x_H.shape[:-1], jnp.float32)
  scale = jnp.max(jnp.abs(x32_H), axis=-1) / 127
  safe = jnp.where(scale > 0, scale, 1)[..., None]  # zeros quantize to 0, not NaN
  return jnp.clip(jnp.round(x32_H / safe), -127, 127).astype(jnp.int8), scale


def dequantize(q_H, scale, dtype):
  """q_H · scale in `dtype` (multiplied in float32: a bfloat16 scale would cost precision)."""
  return (q_H.astype(jnp.float32) * scale[..., None]).astype(dtype)


def write_rows(buf_BS, new_BT, index_B, ring: int = 0):
  """buf_BS with row b's new_BT at slots [index_B[b], index_B[b] + T) (any trailing dims),
  or with `ring` (a ring's S, T <= S) at those slots modulo S."""
  if ring:
    slots_BT = (index_B[:, None] + jnp.arange(new_BT.shape[1], dtype=jnp.int32)[None]) % ring
    rows_BT = jnp.broadcast_to(jnp.arange(slots_BT.shape[0])[:, None], slots_BT.shape)
    return buf_BS.at[rows_BT, slots_BT].set(new_BT, unique_indices=True)
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
  ring: int = 0  # a ring's S: slots wrap (write_rows)

  def attend(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None, window=None):
    """`bias_fn`: a relative position bias (T5), computed from the query and slot positions;
    `window`: the layer's sliding window (models.layers.layer_window; None: cfg's)."""
    window = layer_window(cfg, None) if window is None else window
    if self.cache is None and len(layer_cache) == 4:  # (k, v, k_scale, v_scale): int8
      return self._attend_int8(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                               segment_ids_BT, cfg, bias_fn, window)
    if self.cache is not None:  # layer_cache is the layer: read its slice of the cache
      w = self.width or self.cache.max_len
      layer_cache = (self.cache.k_LBSKH[layer_cache, :, :w],
                     self.cache.v_LBSKH[layer_cache, :, :w])
    k_BSKH, v_BSKH = layer_cache
    names = kv_axes(k_BSKH.shape[2])[1:]
    k_BSKH = constrain(write_rows(k_BSKH, k_BTKH.astype(k_BSKH.dtype), self.index_B, self.ring),
                       names)
    v_BSKH = constrain(write_rows(v_BSKH, v_BTKH.astype(v_BSKH.dtype), self.index_B, self.ring),
                       names)
    out_BTNH = self.slot_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT, cfg,
                                   bias_fn, window)
    # In place only the chunk leaves the scan; otherwise the layer's whole updated slice.
    return out_BTNH, ((k_BTKH, v_BTKH) if self.cache is not None else (k_BSKH, v_BSKH))

  def _attend_int8(self, layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
                   bias_fn, window):
    """Writes the chunk quantized; attends over this layer's slots dequantized (never stored)."""
    k_BSKH, v_BSKH, k_scale_BSK, v_scale_BSK = layer_cache
    kq_BTKH, k_scale_BTK = quantize(k_BTKH)
    vq_BTKH, v_scale_BTK = quantize(v_BTKH)
    write = lambda buf, new, names: constrain(write_rows(buf, new, self.index_B, self.ring), names)
    axes = kv_axes(k_BSKH.shape[2])
    k_BSKH, v_BSKH = write(k_BSKH, kq_BTKH, axes[1:]), write(v_BSKH, vq_BTKH, axes[1:])
    k_scale_BSK = write(k_scale_BSK, k_scale_BTK, axes[1:-1])
    v_scale_BSK = write(v_scale_BSK, v_scale_BTK, axes[1:-1])
    out_BTNH = self.slot_attention(q_BTNH, dequantize(k_BSKH, k_scale_BSK, q_BTNH.dtype),
                                   dequantize(v_BSKH, v_scale_BSK, q_BTNH.dtype), positions_BT,
                                   segment_ids_BT, cfg, bias_fn, window)
    return out_BTNH, (k_BSKH, v_BSKH, k_scale_BSK, v_scale_BSK)

  def slot_attention(self, q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT, cfg, bias_fn,
                     window):
    """Causal attention of the chunk over k_BSKH/v_BSKH, slots already holding the chunk:
    their segment ids, positions and prefix marks are these slots' own."""
    s = k_BSKH.shape[1]  # the slots read: all, or the first `width`
    prefix_BS = None if self.prefix_BS is None else self.prefix_BS[:, :s]
    return attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                     kv_segment_ids_BS=self.segment_ids_BS[:, :s], q_positions_BT=positions_BT,
                     kv_positions_BS=self.positions_BS[:, :s], causal=True,
                     sliding_window=window, impl=cfg.attention_impl, scale=cfg.scale,
                     bias_fn=bias_fn, kv_prefix_BS=prefix_BS, softcap=cfg.attn_softcap,
                     value_dims=cfg.latent_values)


def forward(model, tokens_BT, segment_ids_BT, cache: KVCache, *, all_logits=False, width=None):
  """Appends a chunk to every row: (logits, cache).

  logits_BV at each row's last real token, or with `all_logits` logits_BTV
  at every chunk position. `segment_ids_BT` is 1 for real tokens, 0 for
  padding, and a row's padding comes after its real tokens; a row with none (a
  finished request) leaves its cache as it was, bar an empty slot. The caller
  keeps lengths + T <= S, and with `width` (a static int) lengths + T <= width: a cache read
  in place then attends over slots [0, width) only, so a step's attention costs what the
  batch holds, not what the cache could (an int8 cache ignores it, and so does a one-row cache
  unless the layers run unrolled). A ring (module docstring) takes any lengths; a chunk longer
  than `chunk_limit` runs as consecutive pieces, attending over all S slots.
  """
  t = tokens_BT.shape[1]
  ring = cache.max_len if ring_slots(model.cfg) else 0
  limit = chunk_limit(model.cfg, cache.max_len)
  if limit and t > limit:
    return _pieces(model, tokens_BT, segment_ids_BT, cache, limit, all_logits)
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
  slots = _Slots(write_rows(cache.segment_ids_BS, real_BT, index_B, ring),
                 write_rows(cache.positions_BS, positions_BT, index_B, ring), index_B, prefix_BS,
                 cache if in_place else None, width if in_place else None, ring)
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
    k, v = (write_layers(cache.k_LBSKH, k, slot_of(positions_BT, ring)),
            write_layers(cache.v_LBSKH, v, slot_of(positions_BT, ring)))
  scales = scales or [None, None]
  return logits, constrain_cache(KVCache(k, v, slots.segment_ids_BS,
                                         slots.positions_BS, index_B + n_B, *scales, prefix_BS))


def chunk_limit(cfg: ModelConfig, slots: int) -> int:
  """The longest chunk one pass of `forward` writes into a ring of `slots` slots (0: any)."""
  return slots - cfg.sliding_window + 1 if slots == ring_slots(cfg) else 0


def slot_of(positions_BT, ring: int):
  """The slots of tokens at positions_BT: their positions, modulo a ring's S."""
  return positions_BT % ring if ring else positions_BT


def _pieces(model, tokens_BT, segment_ids_BT, cache: KVCache, limit: int, all_logits: bool):
  """`forward` of a chunk too long for the ring, as a scan over pieces of `limit` tokens:
  each row's logits come from the piece holding its last real token."""
  b, t = tokens_BT.shape
  n = -(-t // limit)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, n * limit - t)))  # more padding after the real tokens
  split = lambda x: jnp.swapaxes(pad(x).reshape(b, n, limit), 0, 1)

  def piece(carry, xs):
    cache, last_BV = carry
    tokens_BC, segment_ids_BC = xs
    logits, cache = forward(model, tokens_BC, segment_ids_BC, cache, all_logits=all_logits)
    if all_logits:
      return (cache, last_BV), logits
    return (cache, jnp.where(jnp.any(segment_ids_BC > 0, axis=1)[:, None], logits, last_BV)), None

  last_BV = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
  (cache, last_BV), outs = jax.lax.scan(piece, (cache, last_BV),
                                        (split(tokens_BT), split(segment_ids_BT)))
  if not all_logits:
    return last_BV, cache
  return jnp.swapaxes(outs, 0, 1).reshape(b, n * limit, -1)[:, :t], cache


class _LayerWrites:
  """What Attention.decode calls per layer when the layers run unrolled
  (models/layer_weights.py): writes the chunk into layer `layer` of the donated cache, then
  attends over that layer's slots. Each write is ordered after the previous layer's read by
  the data flow, so XLA updates the cache in place; the scan form instead hands the chunks
  out and writes them after the last layer (a scan body cannot update a buffer it reads)."""

  def __init__(self, slots: "_Slots", k_LBSKH, v_LBSKH):
    self.slots, self.k_LBSKH, self.v_LBSKH = slots, k_LBSKH, v_LBSKH

  def attend(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None, window=None):
    window = layer_window(cfg, None) if window is None else window
    slots_BT = slot_of(positions_BT, self.slots.ring)
    self.k_LBSKH = write_layers(self.k_LBSKH, k_BTKH, slots_BT, layer)
    self.v_LBSKH = write_layers(self.v_LBSKH, v_BTKH, slots_BT, layer)
    w = self.slots.width or self.k_LBSKH.shape[2]
    axes = kv_axes(self.k_LBSKH.shape[3])[1:]
    k_BSKH = constrain(self.k_LBSKH[layer, :, :w], axes)
    v_BSKH = constrain(self.v_LBSKH[layer, :, :w], axes)
    out_BTNH = self.slots.slot_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT,
                                         cfg, bias_fn, window)
    return out_BTNH, None


def truncate(cache: KVCache, lengths_B) -> KVCache:
  """The cache with row b cut back to its first lengths_B[b] tokens (rejected drafts dropped)."""
  keep_BS = cache.positions_BS < lengths_B[:, None]  # by position: a ring's slots wrap
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
