"""Decoder building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Every parameter carries logical axis names in its `out_sharding` metadata and
large activations are constrained by logical name; see docs/architecture.md for
the dimension letters used in variable names and einsums.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.config import ModelConfig
from parallel import constrain


def _param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float) -> nnx.Param:
  value = std * jax.random.normal(rngs.params(), shape, cfg.jnp_param_dtype)
  # Shardings are applied by parallel/ when the model is created under jit.
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def project(spec: str, x, w: nnx.Variable, dtype, **kwargs) -> jax.Array:
  """jnp.einsum(spec, x, w) computed in `dtype`.

  A weight whose value is not an array but has its own `einsum` (a quantized
  weight, infer/quant) computes the product itself, so quantizing a model
  changes its parameters, never this code.
  """
  value = w[...]
  if hasattr(value, "einsum") and not isinstance(value, jax.Array):
    return value.einsum(spec, x, dtype, **kwargs)
  return jnp.einsum(spec, x, value.astype(dtype), **kwargs)


def lookup(w: nnx.Variable, ids, dtype) -> jax.Array:
  """Rows `ids` of w (an embedding lookup), in `dtype`; quantized weights dequantize just those."""
  value = w[...]
  if hasattr(value, "einsum") and not isinstance(value, jax.Array):
    return value.take(ids, dtype)
  return jnp.take(value, ids, axis=0).astype(dtype)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32."""

  def __init__(self, cfg: ModelConfig):
    self.eps = cfg.norm_eps
    self.dtype = cfg.jnp_dtype
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.jnp_param_dtype), out_sharding=("embed",),
                           eager_sharding=False)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split ("rotate_half") layout as in Hugging Face Llama."""
  h = x_BTNH.shape[-1]
  inv_freq_H2 = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  angle_BTH2 = positions_BT[..., None].astype(jnp.float32) * inv_freq_H2
  sin, cos = jnp.sin(angle_BTH2)[:, :, None, :], jnp.cos(angle_BTH2)[:, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


class Attention(nnx.Module):
  """Grouped-query attention: N query heads share K key/value heads in groups of G."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    std = cfg.init_std
    self.wq_DNH = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg, std)
    self.wk_DKH = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, std)
    self.wv_DKH = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, std)
    self.wo_NHD = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), cfg, std)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    cfg = self.cfg
    q_BTNH, k_BSKH, v_BSKH = self._qkv(x_BTD, positions_BT)

    # Training/prefill self-attention: causality by index (packed rows restart
    # positions per segment, which the segment ids already separate).
    out_BTNH = attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                         kv_segment_ids_BS=segment_ids_BT, causal=True,
                         sliding_window=cfg.sliding_window or None, impl=cfg.attention_impl)
    return self._out(out_BTNH)

  def decode(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, cache):
    """Cached attention (inference): (out_BTD, layer_cache).

    `cache` (infer/kv_cache.py, infer/paged.py) decides where keys live: its
    `attend` stores this chunk's keys and values in `layer_cache` and attends
    over everything the row may see. Same projections as `__call__`.
    """
    q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, positions_BT)
    out_BTNH, layer_cache = cache.attend(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                                         segment_ids_BT, self.cfg)
    return self._out(out_BTNH), layer_cache

  def _qkv(self, x_BTD, positions_BT):
    """Query, key and value projections, rotary embeddings applied: (q_BTNH, k_BTKH, v_BTKH)."""
    cfg = self.cfg
    dt = cfg.jnp_dtype
    q_BTNH = project("BTD,DNH->BTNH", x_BTD, self.wq_DNH, dt)
    k_BTKH = project("BTD,DKH->BTKH", x_BTD, self.wk_DKH, dt)
    v_BTKH = project("BTD,DKH->BTKH", x_BTD, self.wv_DKH, dt)
    q_BTNH = constrain(rope(q_BTNH, positions_BT, cfg.rope_theta),
                       ("act_batch", "act_seq", "act_heads", None))
    k_BTKH = constrain(rope(k_BTKH, positions_BT, cfg.rope_theta),
                       ("act_batch", "act_seq", "act_kv_heads", None))
    v_BTKH = constrain(v_BTKH, ("act_batch", "act_seq", "act_kv_heads", None))
    return q_BTNH, k_BTKH, v_BTKH

  def _out(self, out_BTNH):
    dt = self.cfg.jnp_dtype
    out_BTD = project("BTNH,NHD->BTD", out_BTNH, self.wo_NHD, dt)
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    self.dtype = cfg.jnp_dtype
    self.gate_DF = _param(rngs, (d, f), ("embed", "mlp"), cfg, cfg.init_std)
    self.up_DF = _param(rngs, (d, f), ("embed", "mlp"), cfg, cfg.init_std)
    self.down_FD = _param(rngs, (f, d), ("mlp", "embed"), cfg, cfg.init_std)

  def __call__(self, x_BTD):
    dt = self.dtype
    gate_BTF = project("BTD,DF->BTF", x_BTD, self.gate_DF, dt)
    up_BTF = project("BTD,DF->BTF", x_BTD, self.up_DF, dt)
    h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_seq", "act_mlp"))
    out_BTD = project("BTF,FD->BTD", h_BTF, self.down_FD, dt)
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))
