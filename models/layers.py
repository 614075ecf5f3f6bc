"""The building blocks every architecture shares: norms, rotary embeddings, attention, MLP.

One Attention serves causal, bidirectional, prefix-LM and cross-attention, with
or without biases, rotary embeddings or a relative position bias; one MLP
serves SwiGLU, GEGLU, GELU and ReLU. Architectures (models/registry.py) only
choose among them by config. Every parameter carries logical axis names in its `out_sharding` metadata and
large activations are constrained by logical name; see docs/architecture.md for
the dimension letters used in variable names and einsums.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import attention
from models import matmul as matmul_lib
from models import rope as rope_lib
from models.config import ModelConfig
from parallel import constrain


def normal_param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float) -> nnx.Param:
  """A Param of N(0, std^2) values in cfg's param dtype, its axes named `names`."""
  value = std * jax.random.normal(rngs.params(), shape, cfg.jnp_param_dtype)
  # Shardings are applied by parallel/ when the model is created under jit.
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def zeros_param(shape, names, cfg: ModelConfig) -> nnx.Param:
  """A Param of zeros (a bias) in cfg's param dtype, its axes named `names`."""
  return nnx.Param(jnp.zeros(shape, cfg.jnp_param_dtype), out_sharding=names,
                   eager_sharding=False)


def _add_bias(x, b: nnx.Param | None, dtype):
  return x if b is None else x + b[...].astype(dtype)


def project(spec: str, x, w: nnx.Variable, dtype, matmul: str = "einsum", **kwargs) -> jax.Array:
  """jnp.einsum(spec, x, w) computed in `dtype`, in the form `matmul` names (models/matmul.py).

  A weight whose value is not an array but has its own `einsum` (a quantized
  weight, infer/quant) computes the product itself, so quantizing a model
  changes its parameters, never this code.
  """
  value = w[...]
  if hasattr(value, "einsum") and not isinstance(value, jax.Array):
    return value.einsum(spec, x, dtype, **kwargs)
  return matmul_lib.einsum(spec, x, cast(w, dtype), matmul, **kwargs)


def cast(w: nnx.Variable, dtype) -> jax.Array:
  """w's value in `dtype`, converted where it is stored: a sharded weight shard by shard, so
  FSDP gathers it in `dtype`. Left alone, XLA's partitioner may gather first and convert
  after, moving and holding float32 (the TPU compiler did for llama3_8b_pod's 2 GiB output
  table)."""
  value = w[...]
  if value.dtype == jnp.dtype(dtype):
    return value
  names = w.get_metadata().get("out_sharding")
  out = value.astype(dtype)
  return constrain(out, names) if names and len(names) == value.ndim else out


def lookup(w: nnx.Variable, ids, dtype) -> jax.Array:
  """Rows `ids` of w (an embedding lookup), in `dtype`; quantized weights dequantize just those."""
  value = w[...]
  if hasattr(value, "einsum") and not isinstance(value, jax.Array):
    return value.take(ids, dtype)
  return jnp.take(value, ids, axis=0).astype(dtype)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * (offset + scale), computed in float32 (T5's "layer norm" is this too;
  Gemma's offset is 1, its scale starting at 0)."""

  def __init__(self, cfg: ModelConfig, dim: int | None = None, axis: str = "embed",
               lead: tuple[int, str] | None = None):
    """Over the last axis: d_model by default; `dim` and its logical `axis` name otherwise
    (Qwen3's per-head query/key norm: head_dim). `lead` (size, logical name): over the last
    two axes, one scale per element (OLMoE's norm across all heads: (heads, "heads"))."""
    self.eps = cfg.norm_eps
    self.dtype = cfg.jnp_dtype
    self.offset = cfg.norm_offset
    shape, names = ((dim or cfg.d_model,), (axis,))
    if lead is not None:
      shape, names = (lead[0], *shape), (lead[1], *names)
    self.scale = nnx.Param(jnp.full(shape, 1.0 - self.offset, cfg.jnp_param_dtype),
                           out_sharding=names, eager_sharding=False)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    over = tuple(range(-self.scale.ndim, 0))
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=over, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (x * (self.offset + scale if self.offset else scale)).astype(self.dtype)


class LayerNorm(RMSNorm):
  """y = (x - mean) / std * scale + bias, computed in float32 (BERT)."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    self.bias = zeros_param((cfg.d_model,), ("embed",), cfg)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    y = x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


def Norm(cfg: ModelConfig) -> RMSNorm:  # noqa: N802 (a module factory, used like a class)
  """The norm `cfg.norm` names."""
  return LayerNorm(cfg) if cfg.norm == "layer" else RMSNorm(cfg)


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, cfg: ModelConfig, local=False,
         length_B=None) -> jax.Array:
  """Rotary embedding of `cfg` (its base and context-extension scheme: models/rope.py); a local
  layer's (`local`: a bool, or traced in a layer scan) own base where cfg.rope_local_theta.
  `length_B`: the rows' lengths, for the schemes that depend on them (rope.row_lengths)."""
  if not cfg.rope_local_theta or local is False:
    return rope_lib.apply(x_BTNH, positions_BT, cfg.rope_theta, cfg.rope, length_B=length_B)
  local_BTNH = rope_lib.apply(x_BTNH, positions_BT, cfg.rope_local_theta)
  if local is True:
    return local_BTNH
  global_BTNH = rope_lib.apply(x_BTNH, positions_BT, cfg.rope_theta, cfg.rope, length_B=length_B)
  return jnp.where(local, local_BTNH, global_BTNH)


# A global layer's window where windows are traced: wider than any context.
NO_WINDOW = 1 << 30


def layer_window(cfg: ModelConfig, layer):
  """Layer `layer`'s sliding window: cfg's (0: none) for every layer without a pattern; with
  one, by the layer's kind, static for a Python int and traced (NO_WINDOW if global) for a
  traced index (a layer scan)."""
  if not cfg.layer_pattern:
    return cfg.sliding_window
  if layer is None:
    raise ValueError(f"model.layer_pattern={cfg.layer_pattern!r}: attention needs its layer index")
  if isinstance(layer, (int, np.integer)):
    return cfg.sliding_window if cfg.local_layer(int(layer)) else 0
  return jnp.where(is_local(cfg, layer), cfg.sliding_window, NO_WINDOW)


def is_local(cfg: ModelConfig, layer):
  """Whether layer `layer` is local: a bool, or traced for a traced index."""
  if not cfg.layer_pattern:
    return bool(cfg.sliding_window)
  if isinstance(layer, (int, np.integer)):
    return cfg.local_layer(int(layer))
  if layer is None:
    raise ValueError(f"model.layer_pattern={cfg.layer_pattern!r}: attention needs its layer index")
  kinds = jnp.asarray([cfg.local_layer(i) for i in range(len(cfg.layer_pattern))])
  return kinds[layer % len(cfg.layer_pattern)]


def _lengths(cfg: ModelConfig, positions_BT, segment_ids_BT):
  """The rows' lengths where cfg's RoPE depends on them (dynamic, longrope), else None: a
  right-padded chunk's padding does not count."""
  if cfg.rope_scaling not in rope_lib.BY_LENGTH or positions_BT is None:
    return None
  return rope_lib.row_lengths(positions_BT, segment_ids_BT)


class Attention(nnx.Module):
  """Grouped-query attention: N query heads share K key/value heads in groups of G.

  One module for every use: self-attention (causal, bidirectional or prefix-LM,
  by the call's `causal`/`prefix_BT`) and cross-attention (`kv_BSD`: keys and
  values from another sequence, e.g. an encoder's output, or the (k_BSKH,
  v_BSKH) that `cross_kv` computed from it once). `cfg.position`
  decides whether rotary embeddings are applied (only to self-attention);
  a relative position bias arrives as `bias_fn` (models/positions.py).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    std = cfg.init_std
    self.wq_DNH = normal_param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg, std)
    self.wk_DKH = normal_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, std)
    self.wv_DKH = normal_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, std)
    self.wo_NHD = normal_param(rngs, (n, h, d), ("heads", "head_dim", "embed"), cfg, std)
    if cfg.use_bias or cfg.qkv_bias:
      self.bq_NH = zeros_param((n, h), ("heads", "head_dim"), cfg)
      self.bk_KH = zeros_param((k, h), ("kv_heads", "head_dim"), cfg)
      self.bv_KH = zeros_param((k, h), ("kv_heads", "head_dim"), cfg)
    if cfg.use_bias:
      self.bo_D = zeros_param((d,), ("embed",), cfg)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's query and key, before RoPE
      self.q_norm = RMSNorm(cfg, h, "head_dim")
      self.k_norm = RMSNorm(cfg, h, "head_dim")
    if cfg.qk_norm_full:  # OLMoE: over all heads' features at once
      self.q_norm = RMSNorm(cfg, h, "head_dim", lead=(n, "heads"))
      self.k_norm = RMSNorm(cfg, h, "head_dim", lead=(k, "kv_heads"))

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, *, causal=True, prefix_BT=None,
               bias_fn=None, kv_BSD=None, kv_segment_ids_BS=None, layer=None):
    """Self-attention over x_BTD, or cross-attention to kv_BSD (never causal, no rotary).

    Segment ids separate packed documents (0: padding); in cross-attention a
    query sees the keys of its own segment in kv_segment_ids_BS. `layer`: this layer's
    index in its stack (an int, or traced in a scan), for cfg.layer_pattern's kinds.
    """
    cfg = self.cfg
    if kv_BSD is None:
      q_BTNH, k_BSKH, v_BSKH = self._qkv(x_BTD, positions_BT, layer,
                                         _lengths(cfg, positions_BT, segment_ids_BT))
      window = layer_window(cfg, layer)
      # Training/prefill: causality by index (packed rows restart positions per
      # segment, which the segment ids already separate).
      out_BTNH = attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                           kv_segment_ids_BS=segment_ids_BT, causal=causal,
                           kv_prefix_BS=prefix_BT, bias_fn=bias_fn,
                           sliding_window=window if causal else None,
                           impl=cfg.attention_impl, scale=cfg.scale, softcap=cfg.attn_softcap)
    else:
      q_BTNH = self._q(x_BTD, None)
      k_BSKH, v_BSKH = kv_BSD if isinstance(kv_BSD, tuple) else self.cross_kv(kv_BSD)
      out_BTNH = attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT=segment_ids_BT,
                           kv_segment_ids_BS=kv_segment_ids_BS, causal=False, bias_fn=bias_fn,
                           impl=cfg.attention_impl, scale=cfg.scale, softcap=cfg.attn_softcap)
    return self._out(out_BTNH)

  def decode(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, cache, bias_fn=None,
             layer=None):
    """Cached causal self-attention (inference): (out_BTD, layer_cache).

    `cache` (infer/kv_cache.py, infer/paged.py) decides where keys live: its
    `attend` stores this chunk's keys and values in `layer_cache` and attends
    over everything the row may see, within `window` (this layer's: `layer_window`).
    Same projections as `__call__`.
    """
    q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, positions_BT, layer,
                                       _lengths(self.cfg, positions_BT, segment_ids_BT))
    extra = {} if bias_fn is None else {"bias_fn": bias_fn}
    out_BTNH, layer_cache = cache.attend(layer_cache, q_BTNH, k_BTKH, v_BTKH, positions_BT,
                                         segment_ids_BT, self.cfg,
                                         window=layer_window(self.cfg, layer), **extra)
    return self._out(out_BTNH), layer_cache

  def cross_kv(self, kv_BSD):
    """(k_BSKH, v_BSKH) of another sequence, for cross-attention (no rotary embeddings)."""
    return self._kv(kv_BSD, None)

  def _qkv(self, x_BTD, positions_BT, layer=None, length_B=None):
    """Query, key and value projections, rotary embeddings applied: (q_BTNH, k_BTKH, v_BTKH)."""
    local = is_local(self.cfg, layer)
    return (self._q(x_BTD, positions_BT, local, length_B),
            *self._kv(x_BTD, positions_BT, local, length_B))

  def _q(self, x_BTD, positions_BT, local=False, length_B=None):
    cfg = self.cfg
    dt = cfg.jnp_dtype
    q_BTNH = _add_bias(self._proj("BTD,DNH->BTNH", x_BTD, self.wq_DNH), self._b("bq_NH"), dt)
    if cfg.qk_norm or cfg.qk_norm_full:
      q_BTNH = self.q_norm(q_BTNH)
    if positions_BT is not None and cfg.position == "rope":
      q_BTNH = rope(q_BTNH, positions_BT, cfg, local, length_B)
    return constrain(q_BTNH, ("act_batch", "act_seq", "act_heads", None))

  def _kv(self, x_BSD, positions_BS, local=False, length_B=None):
    cfg = self.cfg
    dt = cfg.jnp_dtype
    k_BSKH = _add_bias(self._proj("BTD,DKH->BTKH", x_BSD, self.wk_DKH), self._b("bk_KH"), dt)
    v_BSKH = _add_bias(self._proj("BTD,DKH->BTKH", x_BSD, self.wv_DKH), self._b("bv_KH"), dt)
    if cfg.qk_norm or cfg.qk_norm_full:
      k_BSKH = self.k_norm(k_BSKH)
    if positions_BS is not None and cfg.position == "rope":
      k_BSKH = rope(k_BSKH, positions_BS, cfg, local, length_B)
    return (constrain(k_BSKH, ("act_batch", "act_seq", "act_kv_heads", None)),
            constrain(v_BSKH, ("act_batch", "act_seq", "act_kv_heads", None)))

  def _b(self, name):
    return getattr(self, name, None)

  def _proj(self, spec, x, w):
    return project(spec, x, w, self.cfg.jnp_dtype, self.cfg.matmul)

  def _out(self, out_BTNH):
    dt = self.cfg.jnp_dtype
    out_BTD = _add_bias(self._proj("BTNH,NHD->BTD", out_BTNH, self.wo_NHD), self._b("bo_D"), dt)
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))


_ACTIVATIONS = {
    "swiglu": jax.nn.silu,
    "geglu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


class MLP(nnx.Module):
  """down(act(gate(x)) * up(x)) for the gated activations (swiglu, geglu), else down(act(up(x)))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    self.dtype = cfg.jnp_dtype
    self.activation = cfg.mlp_activation
    self.use_bias = cfg.use_bias
    self.matmul = cfg.matmul
    if self.gated:
      self.gate_DF = normal_param(rngs, (d, f), ("embed", "mlp"), cfg, cfg.init_std)
    self.up_DF = normal_param(rngs, (d, f), ("embed", "mlp"), cfg, cfg.init_std)
    self.down_FD = normal_param(rngs, (f, d), ("mlp", "embed"), cfg, cfg.init_std)
    if cfg.use_bias:
      if self.gated:
        self.gate_F = zeros_param((f,), ("mlp",), cfg)
      self.up_F = zeros_param((f,), ("mlp",), cfg)
      self.down_D = zeros_param((d,), ("embed",), cfg)

  @property
  def gated(self) -> bool:
    return self.activation in ("swiglu", "geglu")

  def __call__(self, x_BTD):
    dt = self.dtype
    act = _ACTIVATIONS[self.activation]
    up_BTF = _add_bias(project("BTD,DF->BTF", x_BTD, self.up_DF, dt, self.matmul),
                       self.up_F if self.use_bias else None, dt)
    if self.gated:
      gate_BTF = _add_bias(project("BTD,DF->BTF", x_BTD, self.gate_DF, dt, self.matmul),
                           self.gate_F if self.use_bias else None, dt)
      h_BTF = act(gate_BTF) * up_BTF
    else:
      h_BTF = act(up_BTF)
    h_BTF = constrain(h_BTF, ("act_batch", "act_seq", "act_mlp"))
    out_BTD = _add_bias(project("BTF,FD->BTD", h_BTF, self.down_FD, dt, self.matmul),
                        self.down_D if self.use_bias else None, dt)
    return constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed"))
