"""Packed prefill: a batch's prompts packed into one row, attended within each prompt, their
keys and values scattered into the rows of an empty contiguous cache (infer/kv_cache.py).
Padding every prompt to the longest costs prefill time in proportion; packing pads the sum
once."""

import jax
import jax.numpy as jnp

import parallel
from infer import kv_cache
from infer.kv_cache import KVCache, constrain_cache
from models.attention import attention
from models.layers import layer_window

# Packed prefill's blockwise tiles: key/value tiles of this many tokens, so that the kernel
# skips the many tiles in which no query sees a key (those lying wholly across two prompts).
# SmolLM2-135M, 8 prompts packed into 384 tokens, on CPU: 0.86x the time of the naive
# kernel's one masked [384, 384] score matrix (benchmarks/decode_split.py --parts tiles).
PACKED_TILE = 32


class _Packed:
  """What Attention.decode calls per layer at a packed prefill: causal attention within each
  prompt (segment), handing the keys and values out of the layer scan."""

  def attend(self, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg,
             bias_fn=None, window=None):
    window = layer_window(cfg, None) if window is None else window
    impl, tile = cfg.attention_impl, {}
    # "auto" on CPU: tiles (measured). On GPU/TPU "auto" keeps its own choice, unmeasured
    # here; a position bias, soft caps or a traced window run on the naive kernel whatever is
    # asked, so none is asked.
    naive_only = bias_fn is not None or cfg.attn_softcap or isinstance(window, jax.Array)
    if not naive_only and (impl == "blockwise" or (
        impl == "auto" and parallel.platform() not in ("gpu", "tpu"))):
      impl, tile = "blockwise", dict(block_q=PACKED_TILE, block_kv=PACKED_TILE)
    out_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, q_segment_ids_BT=segment_ids_BT,
                         kv_segment_ids_BS=segment_ids_BT, q_positions_BT=positions_BT,
                         kv_positions_BS=positions_BT, causal=True,
                         sliding_window=window, impl=impl, scale=cfg.scale, bias_fn=bias_fn,
                         softcap=cfg.attn_softcap, value_dims=cfg.latent_values, **tile)
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
  if kv_cache.ring_slots(model.cfg) and tokens_1P.shape[1] > cache.max_len:
    raise ValueError(f"packed prefill of {tokens_1P.shape[1]} tokens into a ring of "
                     f"{cache.max_len} slots: a prompt could outrun the ring (kv_cache.forward "
                     "prefills it in pieces)")
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
