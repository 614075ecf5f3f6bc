"""ModelConfig: the shape and numerics of a decoder, validated on construction."""

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_saveable")
MOE_IMPLS = ("dropless", "capacity")
ROUTER_NORMS = ("topk", "all")
GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")
ATTENTION_IMPLS = ("auto", "naive", "blockwise", "cudnn", "pallas")


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the key and the value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama-style decoder hyper-parameters. `head_dim` defaults to d_model // num_heads."""

  vocab_size: int = 8192
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  mlp_dim: int = 704
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  init_std: float = 0.02
  bos_id: int | None = None
  eos_id: int | None = None
  attention_impl: str = "auto"   # models/attention.py kernel: auto|naive|blockwise|cudnn|pallas
  sliding_window: int = 0         # >0: a query sees only the last `sliding_window` positions
  # Mixture of experts (num_experts=0: every block has a dense SwiGLU MLP).
  num_experts: int = 0           # E routed experts per block, each a SwiGLU of mlp_dim
  top_k: int = 2                 # experts each token is routed to
  moe_impl: str = "dropless"     # "dropless" (sorted grouped matmul) or "capacity" (GShard)
  capacity_factor: float = 1.25  # capacity path: C = ceil(ceil(tokens*k/E) * factor)
  router_norm: str = "topk"      # "topk": softmax over the chosen k (Mixtral); "all": over all E
  shared_mlp_dim: int = 0        # >0: a dense SwiGLU every token also goes through
  aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss weight
  z_loss_weight: float = 0.0     # router z-loss weight (ST-MoE uses 1e-3)
  router_bias_rate: float = 0.0  # >0: auxiliary-loss-free balancing bias step (DeepSeek-V3)
  grouped_matmul: str = "auto"   # dropless kernel; "auto": tiled on CPU, ragged_dot elsewhere

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ConfigError(
            f"model.num_heads={self.num_heads} does not divide model.d_model={self.d_model}"
            " (set model.head_dim explicitly for a non-square attention)")
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"model.num_heads={self.num_heads} is not a multiple of "
          f"model.num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(f"model.{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"model.remat={self.remat!r}; choose one of {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ConfigError(f"model.attention_impl={self.attention_impl!r}; choose one of "
                        f"{ATTENTION_IMPLS}")
    if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
      raise ConfigError(f"model.sliding_window={self.sliding_window!r} must be an integer >= 0 "
                        "(0: no window)")
    if self.num_experts:
      self._check_moe()

  def _check_moe(self):
    e, k = self.num_experts, self.top_k
    if not isinstance(e, int) or e < 0:
      raise ConfigError(f"model.num_experts must be a non-negative integer, got {e!r}")
    if not isinstance(k, int) or k < 1:
      raise ConfigError(f"model.top_k must be a positive integer, got {k!r}")
    if k > e:
      raise ConfigError(f"model.top_k={k} > model.num_experts={e}: a token cannot be routed to "
                        "more experts than exist")
    for name, allowed in (("moe_impl", MOE_IMPLS), ("router_norm", ROUTER_NORMS),
                          ("grouped_matmul", GROUPED_MATMULS)):
      if getattr(self, name) not in allowed:
        raise ConfigError(f"model.{name}={getattr(self, name)!r}; choose one of {allowed}")
    if self.moe_impl == "capacity" and not self.capacity_factor > 0:
      raise ConfigError(f"model.capacity_factor={self.capacity_factor!r} must be > 0 on the "
                        "capacity path (model.moe_impl='capacity')")
    for name in ("aux_loss_weight", "z_loss_weight", "router_bias_rate", "shared_mlp_dim"):
      if getattr(self, name) < 0:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} must be >= 0")

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def q_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a dict/ConfigDict, naming any key ModelConfig does not have."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown model config key(s) {unknown}; known keys: {sorted(known)}")
    return cls(**dict(values))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def mlp_params(self, active: bool = False) -> int:
    """Weights of one block's MLP or MoE layer; `active`: those one token uses."""
    d, f = self.d_model, self.mlp_dim
    if not self.is_moe:
      return 3 * d * f
    experts = self.top_k if active else self.num_experts
    bias = 0 if active or not self.router_bias_rate else self.num_experts
    return 3 * d * f * experts + 3 * d * self.shared_mlp_dim + d * self.num_experts + bias

  def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
    d, h = self.d_model, self.head_dim
    attn = d * h * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * h * d
    per_layer = attn + self.mlp_params(active) + 2 * d
    n = self.num_layers * per_layer + d
    if include_embedding:
      n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
    elif not self.tie_embeddings:
      n += self.vocab_size * d  # the unembedding is a real matmul
    return n
