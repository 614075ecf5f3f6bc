"""Decoder building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Every parameter carries logical axis names in its `out_sharding` metadata and
large activations are constrained by logical name; see docs/architecture.md for
the dimension letters used in variable names and einsums.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from parallel import constrain


def _param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float) -> nnx.Param:
  value = std * jax.random.normal(rngs.params(), shape, cfg.jnp_param_dtype)
  # Shardings are applied by parallel/ when the model is created under jit.
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


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


def attention_mask(segment_ids_BT: jax.Array | None, q_len: int, k_len: int) -> jax.Array:
  """Causal mask, also blocking attention across packed documents: [B|1, T, S] bool."""
  causal_TS = jnp.arange(q_len)[:, None] >= jnp.arange(k_len)[None, :]
  if segment_ids_BT is None:
    return causal_TS[None]
  same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal_TS[None] & same_BTS


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
    dt = cfg.jnp_dtype
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, self.wq_DNH[...].astype(dt))
    k_BSKH = jnp.einsum("BSD,DKH->BSKH", x_BTD, self.wk_DKH[...].astype(dt))
    v_BSKH = jnp.einsum("BSD,DKH->BSKH", x_BTD, self.wv_DKH[...].astype(dt))
    q_BTNH = constrain(rope(q_BTNH, positions_BT, cfg.rope_theta), ("act_batch", "act_seq", "act_heads", None))
    k_BSKH = constrain(rope(k_BSKH, positions_BT, cfg.rope_theta), ("act_batch", "act_seq", "act_kv_heads", None))
    v_BSKH = constrain(v_BSKH, ("act_batch", "act_seq", "act_kv_heads", None))

    b, t = x_BTD.shape[:2]
    q_BTKGH = q_BTNH.reshape(b, t, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH).astype(jnp.float32)
    scores_BKGTS = scores_BKGTS * (cfg.head_dim ** -0.5)
    mask_B11TS = attention_mask(segment_ids_BT, t, t)[:, None, None]
    scores_BKGTS = jnp.where(mask_B11TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(dt)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
    out_BTNH = out_BTKGH.reshape(b, t, cfg.num_heads, cfg.head_dim)
    out_BTD = jnp.einsum("BTNH,NHD->BTD", out_BTNH, self.wo_NHD[...].astype(dt))
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
    gate_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, self.gate_DF[...].astype(dt))
    up_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, self.up_DF[...].astype(dt))
    h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_seq", "act_mlp"))
    out_BTD = jnp.einsum("BTF,FD->BTD", h_BTF, self.down_FD[...].astype(dt))
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))
