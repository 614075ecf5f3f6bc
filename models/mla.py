"""Multi-head latent attention (DeepSeek-V2/V3): every head's key and value from one latent.

A token's keys and values come from a latent c_C = norm(x·W_DC) of C = kv_lora_rank features
and one rotary key kr_R = rope(x·W_DR) (R = rope_head_dim) that every head shares:

  k_n = [c·Wk_n, kr]      v_n = c·Wv_n      q_n = [q_n's H plain features, rope(its R)]

with the queries projected directly or through their own normalised latent (q_lora_rank).

Training runs the expanded form: per-head keys (H + R wide) and values (U wide) into the
shared `attention`. The caches (infer/) hold only [c, kr] per token and layer, one (C + R)-wide
"head", and decode attends in the absorbed form: q_n's plain features are folded through Wk_n
into the latent space (q_n·Wk_nᵀ, C wide), so the scores [q_n·Wk_nᵀ, rope q_n]·[c, kr] are
the expanded form's, the values are the latent's first C features (`attention(value_dims=C)`)
and Wv_n maps each head's output out of the latent after the softmax. A cache entry is C + R
values against N·(H + R + U) for cached keys and values: DeepSeek-V3's 576 against 40,960.

Letters local to this file: C the key/value latent, Q the query latent, R a head's rotary
features, U a head's value features, X = H + R a query's; H a head's plain query/key features.
"""

import jax.numpy as jnp
from flax import nnx

from models import rope as rope_lib
from models.attention import attention
from models.config import ModelConfig
from models.layers import RMSNorm, cast, normal_param, project
from parallel import constrain

# DeepSeek's latent norms are built with RMSNorm's default epsilon, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
  """Causal self-attention through compressed keys and values; Attention's interface
  (`__call__` for training and prefill-free forwards, `decode` against a cache)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, h, r = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.rope_head_dim
    c, q, u = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.value_dim
    self.cfg = cfg
    std = cfg.init_std
    if q:
      self.wq_a_DQ = normal_param(rngs, (d, q), ("embed", "q_lora"), cfg, std)
      self.q_norm = _latent_norm(cfg, q, "q_lora")
      self.wq_b_QNX = normal_param(rngs, (q, n, h + r), ("q_lora", "heads", "head_dim"), cfg, std)
    else:
      self.wq_DNX = normal_param(rngs, (d, n, h + r), ("embed", "heads", "head_dim"), cfg, std)
    self.wkv_a_DC = normal_param(rngs, (d, c), ("embed", "kv_lora"), cfg, std)
    self.wkr_DR = normal_param(rngs, (d, r), ("embed", "head_dim"), cfg, std)
    self.kv_norm = _latent_norm(cfg, c, "kv_lora")
    self.wk_b_CNH = normal_param(rngs, (c, n, h), ("kv_lora", "heads", "head_dim"), cfg, std)
    self.wv_b_CNU = normal_param(rngs, (c, n, u), ("kv_lora", "heads", "head_dim"), cfg, std)
    self.wo_NUD = normal_param(rngs, (n, u, d), ("heads", "head_dim", "embed"), cfg, std)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, *, causal=True, prefix_BT=None,
               bias_fn=None, kv_BSD=None, kv_segment_ids_BS=None, layer=None):
    cfg = self.cfg
    if kv_BSD is not None or bias_fn is not None or not causal or prefix_BT is not None:
      raise ValueError("latent attention is causal self-attention with rotary positions only")
    q_BTNX = self._q(x_BTD, positions_BT)
    c_BSC, kr_BSR = self._latent(x_BTD, positions_BT)
    k_BSNH = self._proj("BSC,CNH->BSNH", c_BSC, self.wk_b_CNH)
    v_BSNU = self._proj("BSC,CNU->BSNU", c_BSC, self.wv_b_CNU)
    kr_BSNR = jnp.broadcast_to(kr_BSR[:, :, None], (*k_BSNH.shape[:3], cfg.rope_head_dim))
    k_BSNX = constrain(jnp.concatenate([k_BSNH, kr_BSNR], axis=-1),
                       ("act_batch", "act_seq", "act_heads", None))
    out_BTNU = attention(q_BTNX, k_BSNX, v_BSNU, q_segment_ids_BT=segment_ids_BT,
                         kv_segment_ids_BS=segment_ids_BT, causal=True,
                         impl=cfg.attention_impl, scale=cfg.scale)
    return self._out(out_BTNU)

  def decode(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, cache, bias_fn=None,
             layer=None):
    """Cached attention in the absorbed form (module docstring): the cache stores [c, kr] as
    one key head and no value. (out_BTD, layer_cache)."""
    cfg = self.cfg
    if bias_fn is not None:
      raise ValueError("latent attention has no relative position bias")
    q_BTNX = self._q(x_BTD, positions_BT)
    h = cfg.head_dim
    q_lat_BTNC = self._per_head("BTNH,CNH->BTNC", q_BTNX[..., :h], self.wk_b_CNH)
    q_BTNY = jnp.concatenate([q_lat_BTNC, q_BTNX[..., h:]], axis=-1)  # Y = C + R
    c_BTC, kr_BTR = self._latent(x_BTD, positions_BT)
    key_BT1Y = jnp.concatenate([c_BTC, kr_BTR], axis=-1)[:, :, None]
    none_BT10 = jnp.zeros((*key_BT1Y.shape[:3], 0), key_BT1Y.dtype)
    out_BTNC, layer_cache = cache.attend(layer_cache, q_BTNY, key_BT1Y, none_BT10, positions_BT,
                                         segment_ids_BT, cfg, window=0)
    out_BTNU = self._per_head("BTNC,CNU->BTNU", out_BTNC, self.wv_b_CNU)
    return self._out(out_BTNU), layer_cache

  def _q(self, x_BTD, positions_BT):
    """Queries [plain H | rotary R] per head, rotated at positions_BT."""
    cfg = self.cfg
    if cfg.q_lora_rank:
      q_BTQ = self.q_norm(self._proj("BTD,DQ->BTQ", x_BTD, self.wq_a_DQ))
      q_BTNX = self._proj("BTQ,QNX->BTNX", q_BTQ, self.wq_b_QNX)
    else:
      q_BTNX = self._proj("BTD,DNX->BTNX", x_BTD, self.wq_DNX)
    h = cfg.head_dim
    q_BTNX = jnp.concatenate([q_BTNX[..., :h], self._rope(q_BTNX[..., h:], positions_BT)], -1)
    return constrain(q_BTNX, ("act_batch", "act_seq", "act_heads", None))

  def _latent(self, x_BTD, positions_BT):
    """(c_BTC the normalised latent, kr_BTR the shared rotary key)."""
    c_BTC = self.kv_norm(self._proj("BTD,DC->BTC", x_BTD, self.wkv_a_DC))
    kr_BTR = self._proj("BTD,DR->BTR", x_BTD, self.wkr_DR)
    kr_BTR = self._rope(kr_BTR[:, :, None], positions_BT)[:, :, 0]
    return constrain(c_BTC, ("act_batch", "act_seq", None)), kr_BTR

  def _rope(self, x_BTNR, positions_BT):
    cfg = self.cfg
    return rope_lib.apply(x_BTNR, positions_BT, cfg.rope_theta, cfg.rope,
                          interleaved=cfg.rope_interleaved)

  def _proj(self, spec, x, w):
    return project(spec, x, w, self.cfg.jnp_dtype, self.cfg.matmul)

  def _per_head(self, spec, x, w):
    """A product batched over heads (not a projection: models/matmul.py's flat form and
    quantized weights do not take it; these two weights stay float, models/quant/rules.py)."""
    return jnp.einsum(spec, x, cast(w, self.cfg.jnp_dtype))

  def _out(self, out_BTNU):
    out_BTD = self._proj("BTNU,NUD->BTD", out_BTNU, self.wo_NUD)
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))


def _latent_norm(cfg: ModelConfig, dim: int, axis: str) -> RMSNorm:
  norm = RMSNorm(cfg, dim, axis)
  norm.eps = LATENT_NORM_EPS
  return norm
