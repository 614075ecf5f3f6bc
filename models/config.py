"""ModelConfig: the shape and numerics of a decoder, validated on construction."""

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from models.rope import RopeScaling

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_saveable")
MOE_IMPLS = ("dropless", "capacity")
ROUTER_NORMS = ("topk", "all")
GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")
MATMULS = ("auto", "einsum", "flat")
XENTS = ("logits", "chunked")
ATTENTION_IMPLS = ("auto", "naive", "blockwise", "cudnn", "pallas")
ARCHS = ("decoder", "prefix_lm", "encoder", "encoder_decoder")
NORMS = ("rms", "layer")
NORM_POSITIONS = ("pre", "post")
MLP_ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu")
POSITIONS = ("rope", "learned", "relative", "none")
POOLINGS = ("mean", "cls")
ROUTER_SCORES = ("softmax", "sigmoid")


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
  # Context extension (models/rope.py): default | linear | llama3 | yarn, with its parameters
  # under transformers' names (rope_parameters).
  rope_scaling: str = "default"
  rope_factor: float = 1.0
  rope_original_max_len: int = 0    # llama3, yarn: the pretraining context
  rope_low_freq_factor: float = 1.0  # llama3
  rope_high_freq_factor: float = 4.0  # llama3
  rope_beta_fast: float = 32.0       # yarn
  rope_beta_slow: float = 1.0        # yarn
  rope_attention_factor: float = 0.0  # yarn: cos/sin scale (0: 0.1 ln(factor) + 1)
  rope_freq_factors: tuple = ()      # factors: a divisor per frequency (a GGUF's rope_freqs)
  rope_short_factors: tuple = ()     # longrope: divisors within rope_original_max_len
  rope_long_factors: tuple = ()      # longrope: divisors past it
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
  # Local/global layers (Gemma 2, 3): layer i is local (the window) or global (no window) by
  # layer_pattern[i % len]: "LG" alternates, "LLLLLG" is five local to one global; "": all
  # layers alike.
  layer_pattern: str = ""
  rope_local_theta: float = 0.0  # >0: local layers' RoPE base, unscaled (Gemma 3)
  attn_softcap: float = 0.0      # >0: scores -> c·tanh(scores / c) before the mask (Gemma 2)
  final_softcap: float = 0.0     # >0: logits -> c·tanh(logits / c) (Gemma 2)
  embed_scale: bool = False      # embeddings times sqrt(d_model) (Gemma)
  norm_offset: float = 0.0       # RMSNorm multiplies by offset + scale (Gemma: 1, scale from 0)
  sandwich_norms: bool = False   # norms after attention and the MLP too, before the residual
  hf_family: str = ""            # the Hugging Face model_type it was loaded as: export prefers it
  # Multi-head latent attention (DeepSeek-V2/V3; models/mla.py), on where kv_lora_rank > 0:
  # every head's key and value come from one normalised latent of kv_lora_rank features per
  # token, plus one rotary key of rope_head_dim features that all heads share; head_dim is a
  # head's non-rotary query/key width. The Engine caches the latent and the rotary key only.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0           # >0: queries through a normalised latent too (DeepSeek-V3)
  rope_head_dim: int = 0         # MLA: the rotary features of each query and the shared key
  v_head_dim: int = 0            # MLA: a head's value width (0: head_dim)
  rope_interleaved: bool = False  # rotary pairs (x0, x1), (x2, x3)... (DeepSeek), not halves
  # Mixture of experts (num_experts=0: every block has a dense SwiGLU MLP).
  num_experts: int = 0           # E routed experts per block, each a SwiGLU of mlp_dim
  top_k: int = 2                 # experts each token is routed to
  moe_impl: str = "dropless"     # "dropless" (sorted grouped matmul) or "capacity" (GShard)
  capacity_factor: float = 1.25  # capacity path: C = ceil(ceil(tokens*k/E) * factor)
  router_norm: str = "topk"      # "topk": softmax over the chosen k (Mixtral); "all": over all E
  shared_mlp_dim: int = 0        # >0: a dense SwiGLU every token also goes through
  shared_gate: bool = False      # the shared MLP's output times sigmoid(x·w) (Qwen2-MoE)
  aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss weight
  z_loss_weight: float = 0.0     # router z-loss weight (ST-MoE uses 1e-3)
  router_bias_rate: float = 0.0  # >0: auxiliary-loss-free balancing bias step (DeepSeek-V3)
  router_score: str = "softmax"  # expert scores: softmax over all | sigmoid each (DeepSeek-V3)
  router_groups: int = 0         # >1: experts in equal groups, a token choosing among the
  router_group_topk: int = 0     # best router_group_topk groups (DeepSeek's group-limited routing)
  routed_scale: float = 1.0      # the routed experts' weights times this (routed_scaling_factor)
  first_dense_layers: int = 0    # MoE: the first k blocks have a dense MLP instead (DeepSeek)
  dense_mlp_dim: int = 0         # their width (0: mlp_dim)
  grouped_matmul: str = "auto"   # dropless kernel; "auto": tiled on CPU, ragged_dot elsewhere
  matmul: str = "auto"           # projections (models/matmul.py): einsum | flat; "auto": flat on
                                 # a one-device CPU process, einsum elsewhere
  xent: str = "logits"           # training loss (models/xent.py): logits | chunked (fused with
                                 # the unembedding: less memory, no faster on a CPU)
  xent_unroll: bool = False      # chunked: unroll the chunk loop (compile probes: a cost model
                                 # counts a loop body once)
  # Architecture (models/registry.py). The same Attention/MLP/norm modules serve every one.
  arch: str = "decoder"          # decoder | prefix_lm (bidirectional prompt) | encoder | encoder_decoder
  norm: str = "rms"              # rms (RMSNorm, T5's layer norm too) | layer (LayerNorm with bias)
  norm_position: str = "pre"     # pre: x + f(norm(x)); post (BERT): norm(x + f(x))
  mlp_activation: str = "swiglu"  # swiglu | geglu (gated tanh-GELU, T5 v1.1) | gelu (erf) | relu
  use_bias: bool = False         # biases on the q/k/v/o and MLP projections (BERT)
  qkv_bias: bool = False         # biases on the q/k/v projections only (Qwen2)
  qk_norm: bool = False          # RMSNorm over each head's query and key before RoPE (Qwen3)
  qk_norm_full: bool = False     # one RMSNorm over all heads' query (key) features (OLMoE)
  position: str = "rope"         # rope | learned (absolute table) | relative (T5 buckets) | none
  type_vocab_size: int = 0       # >0: token-type (segment A/B) embeddings, BERT
  relative_buckets: int = 32     # position="relative": buckets per direction pair
  relative_max_distance: int = 128  # distance beyond which all offsets share the last bucket
  attention_scale: float = 0.0   # 0: head_dim**-0.5; T5 folds the scale into its init (1.0)
  num_decoder_layers: int = 0    # encoder_decoder: decoder depth (0: num_layers)
  decoder_vocab_size: int = 0    # encoder_decoder: must equal vocab_size (one shared table)
  pooling: str = "mean"          # encoder: sentence embedding / classifier input, mean | cls
  num_classes: int = 0           # encoder: >0 adds a classification head

  def __post_init__(self):
    # a list (from JSON) made a tuple: the config is hashed as a static jit argument
    for name in ("rope_freq_factors", "rope_short_factors", "rope_long_factors"):
      object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
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
    problem = self.rope.check()
    if problem:
      raise ConfigError(f"model.rope_scaling: {problem}")
    if self.head_dim % 2 and self.position == "rope" and not self.kv_lora_rank:
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
    else:
      moe_only = [n for n, off in (("first_dense_layers", 0), ("dense_mlp_dim", 0),
                                   ("router_groups", 0), ("router_group_topk", 0),
                                   ("router_score", "softmax"), ("routed_scale", 1.0))
                  if getattr(self, n) != off]
      if moe_only:
        raise ConfigError(f"model.{moe_only[0]}={getattr(self, moe_only[0])!r} is a mixture-of-"
                          "experts setting; model.num_experts=0")
    self._check_arch()
    self._check_layers()
    self._check_mla()

  def _check_layers(self):
    p = self.layer_pattern
    if not isinstance(p, str) or set(p) - set("LG"):
      raise ConfigError(f"model.layer_pattern={p!r}: a string of L (local: the sliding window) "
                        "and G (global), applied cyclically over the layers; '' for all alike")
    if "L" in p and not self.sliding_window:
      raise ConfigError(f"model.layer_pattern={p!r} has local layers but model.sliding_window=0")
    if self.rope_local_theta and "L" not in p:
      raise ConfigError(f"model.rope_local_theta={self.rope_local_theta} is for local layers; "
                        f"model.layer_pattern={p!r} has none")
    for name in ("attn_softcap", "final_softcap", "rope_local_theta", "norm_offset"):
      if getattr(self, name) < 0:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} must be >= 0")
    if self.norm_offset and self.norm != "rms":
      raise ConfigError(f"model.norm_offset={self.norm_offset} is for RMSNorm (Gemma); "
                        f"model.norm={self.norm!r}")
    if self.qk_norm and self.qk_norm_full:
      raise ConfigError("model.qk_norm (per head) and model.qk_norm_full (across heads) "
                        "exclude each other")
    if self.shared_gate and not self.shared_mlp_dim:
      raise ConfigError("model.shared_gate gates the shared expert: set model.shared_mlp_dim")
    if self.final_softcap and self.xent == "chunked":
      raise ConfigError("model.final_softcap with model.xent='chunked': the fused loss reads raw "
                        "logits; use xent='logits'")

  def _check_mla(self):
    names = ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim")
    for name in names:
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ConfigError(f"model.{name} must be an integer >= 0, got {v!r}")
    if not self.kv_lora_rank:
      extra = [n for n in names[1:] if getattr(self, n)]
      if extra:
        raise ConfigError(f"model.{extra[0]}={getattr(self, extra[0])} is a multi-head latent "
                          "attention setting: set model.kv_lora_rank > 0")
      return
    if not self.rope_head_dim or self.rope_head_dim % 2 or self.position != "rope":
      raise ConfigError(f"latent attention (model.kv_lora_rank={self.kv_lora_rank}) needs an "
                        f"even model.rope_head_dim > 0 and position='rope', got "
                        f"{self.rope_head_dim!r}, {self.position!r}")
    if self.num_kv_heads != self.num_heads:
      raise ConfigError(f"latent attention gives every head its own key and value: model."
                        f"num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads}")
    clash = [n for n in ("use_bias", "qkv_bias", "qk_norm", "qk_norm_full", "sliding_window",
                         "layer_pattern", "attn_softcap") if getattr(self, n)]
    if self.rope_scaling in ("dynamic", "longrope"):  # their lengths are not wired through MLA
      clash.append(f"rope_scaling={self.rope_scaling!r}")
    if clash or self.arch != "decoder":
      raise ConfigError(f"latent attention (model.kv_lora_rank) is for arch='decoder' without "
                        f"{clash or ['arch=' + repr(self.arch)]}")

  def local_layer(self, i: int) -> bool:
    """Whether layer i attends within the sliding window (all layers, without a pattern)."""
    p = self.layer_pattern
    return bool(self.sliding_window) and (not p or p[i % len(p)] == "L")

  @property
  def gemma_features(self) -> bool:
    """Any of the Gemma mechanisms (a Llama export would drop them)."""
    return bool(self.layer_pattern or self.rope_local_theta or self.attn_softcap
                or self.final_softcap or self.embed_scale or self.norm_offset
                or self.sandwich_norms)

  def _check_arch(self):
    for name, allowed in (("arch", ARCHS), ("norm", NORMS), ("norm_position", NORM_POSITIONS),
                          ("mlp_activation", MLP_ACTIVATIONS), ("position", POSITIONS),
                          ("pooling", POOLINGS), ("matmul", MATMULS),
                          ("xent", XENTS)):
      if getattr(self, name) not in allowed:
        raise ConfigError(f"model.{name}={getattr(self, name)!r}; choose one of {allowed}")
    if self.xent == "chunked" and self.arch not in ("decoder", "prefix_lm"):
      raise ConfigError(f"model.xent='chunked' fuses a decoder's unembedding into its loss; "
                        f"arch={self.arch!r} takes 'logits'")
    for name in ("type_vocab_size", "num_decoder_layers", "decoder_vocab_size", "num_classes"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ConfigError(f"model.{name} must be an integer >= 0, got {v!r}")
    if self.attention_scale < 0:
      raise ConfigError(f"model.attention_scale={self.attention_scale} must be >= 0 "
                        "(0: head_dim**-0.5)")
    if self.position == "relative":
      b, m = self.relative_buckets, self.relative_max_distance
      if not isinstance(b, int) or b < 4 or b % 2:
        raise ConfigError(f"model.relative_buckets={b!r} must be an even integer >= 4 (half "
                          "exact offsets, half log-spaced; bidirectional halves them again)")
      if not isinstance(m, int) or m <= b // 2:
        raise ConfigError(f"model.relative_max_distance={m!r} must exceed relative_buckets/2="
                          f"{b // 2}, where the log-spaced buckets start")
    if self.position == "relative" and self.arch == "prefix_lm":
      raise ConfigError("model.position='relative' with arch='prefix_lm': T5's decoder buckets "
                        "are one-directional and the prefix is not; use rope or learned")
    enc_dec = self.arch == "encoder_decoder"
    if self.num_decoder_layers and not enc_dec:
      raise ConfigError(f"model.num_decoder_layers={self.num_decoder_layers} is only for "
                        f"arch='encoder_decoder', not arch={self.arch!r}")
    if self.decoder_vocab_size and self.decoder_vocab_size != self.vocab_size:
      raise ConfigError(
          f"mismatched vocabularies: model.vocab_size={self.vocab_size} (encoder) but "
          f"model.decoder_vocab_size={self.decoder_vocab_size}; an encoder-decoder shares one "
          "vocabulary and embedding table, so use one tokenizer for source and target")
    if self.decoder_vocab_size and not enc_dec:
      raise ConfigError("model.decoder_vocab_size is only for arch='encoder_decoder'")
    if (self.type_vocab_size or self.num_classes) and self.arch != "encoder":
      raise ConfigError("model.type_vocab_size and model.num_classes are encoder options; "
                        f"arch={self.arch!r}")
    if self.arch in ("encoder", "encoder_decoder") and self.num_experts:
      raise ConfigError(f"arch={self.arch!r} with num_experts={self.num_experts}: mixture-of-"
                        "experts blocks are supported in decoder and prefix_lm models only")
    if self.arch != "decoder" and self.sliding_window:
      raise ConfigError(f"model.sliding_window is for arch='decoder' (causal throughout); "
                        f"arch={self.arch!r} attends bidirectionally over (part of) its input")

  @property
  def decoder_layers(self) -> int:
    """Depth of the decoder stack (the only stack, except in an encoder-decoder)."""
    return self.num_decoder_layers or self.num_layers

  @property
  def scale(self) -> float:
    return self.attention_scale or (self.head_dim + self.rope_head_dim) ** -0.5

  @property
  def mla(self) -> bool:
    """Multi-head latent attention (models/mla.py)."""
    return self.kv_lora_rank > 0

  @property
  def value_dim(self) -> int:
    """A head's value width."""
    return self.v_head_dim or self.head_dim

  @property
  def cache_dims(self) -> tuple[int, int, int]:
    """(heads, key width, value width) of a KV cache entry: (num_kv_heads, head_dim, head_dim),
    or for latent attention (1, kv_lora_rank + rope_head_dim, 0): one latent "head" whose first
    kv_lora_rank features are also its value (`latent_values`), so no value is stored."""
    if self.mla:
      return 1, self.kv_lora_rank + self.rope_head_dim, 0
    return self.num_kv_heads, self.head_dim, self.head_dim

  @property
  def latent_values(self) -> int:
    """Latent attention: the cached key's first features that are the value (0: values are
    cached themselves). models.attention.attention's `value_dims`."""
    return self.kv_lora_rank

  @property
  def dense_config(self) -> "ModelConfig":
    """The config of the first_dense_layers blocks: a dense MLP of dense_mlp_dim."""
    return dataclasses.replace(
        self, num_experts=0, mlp_dim=self.dense_mlp_dim or self.mlp_dim, first_dense_layers=0,
        dense_mlp_dim=0, shared_mlp_dim=0, shared_gate=False, router_bias_rate=0.0,
        router_score="softmax", router_groups=0, router_group_topk=0, routed_scale=1.0)

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
    if self.mlp_activation != "swiglu" or self.use_bias:
      raise ConfigError(f"MoE experts are SwiGLU without biases; model.mlp_activation="
                        f"{self.mlp_activation!r}, use_bias={self.use_bias} with num_experts={e}")
    for name in ("aux_loss_weight", "z_loss_weight", "router_bias_rate", "shared_mlp_dim",
                 "dense_mlp_dim", "router_groups", "router_group_topk"):
      if getattr(self, name) < 0:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} must be >= 0")
    if self.router_score not in ROUTER_SCORES:
      raise ConfigError(f"model.router_score={self.router_score!r}; choose one of "
                        f"{ROUTER_SCORES}")
    if not self.routed_scale > 0:
      raise ConfigError(f"model.routed_scale={self.routed_scale!r} must be > 0")
    if not isinstance(self.first_dense_layers, int) or not (
        0 <= self.first_dense_layers < self.num_layers):
      raise ConfigError(f"model.first_dense_layers={self.first_dense_layers!r} must be an "
                        f"integer in [0, num_layers={self.num_layers}): at least one block "
                        "keeps its experts")
    g, gk = self.router_groups, self.router_group_topk
    if g > 1 or gk:
      # sigmoid scores rank a group by its best two experts, softmax ones by its best one
      per = 2 if self.router_score == "sigmoid" else 1
      if g < 2 or e % g or e // g < per or not 1 <= gk <= g or k > gk * (e // g):
        raise ConfigError(
            f"model.router_groups={g}, router_group_topk={gk}: want groups dividing "
            f"num_experts={e} into groups of at least {per}, 1 <= router_group_topk <= groups, "
            f"and top_k={k} experts within the chosen groups")

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
  def rope(self) -> RopeScaling:
    """The rope_* fields as models/rope.py takes them (rope_X is its X; rope_scaling its kind)."""
    return RopeScaling(kind=self.rope_scaling, **{
        f.name: getattr(self, "rope_" + f.name) for f in dataclasses.fields(RopeScaling)
        if hasattr(self, "rope_" + f.name)})

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def mlp_params(self, active: bool = False) -> int:
    """Weights of one block's MLP or MoE layer; `active`: those one token uses."""
    d, f = self.d_model, self.mlp_dim
    if not self.is_moe:
      return (3 if self.mlp_activation in ("swiglu", "geglu") else 2) * d * f
    experts = self.top_k if active else self.num_experts
    bias = 0 if active or not self.router_bias_rate else self.num_experts
    gate = d if self.shared_gate else 0
    return 3 * d * f * experts + 3 * d * self.shared_mlp_dim + d * self.num_experts + bias + gate

  @property
  def llama_shaped(self) -> bool:
    """A decoder whose parameters the closed form below counts (gated MLP, no biases)."""
    return (self.arch in ("decoder", "prefix_lm") and self.norm == "rms" and not self.use_bias
            and self.norm_position == "pre" and self.position in ("rope", "none")
            and self.mlp_activation in ("swiglu", "geglu"))

  @property
  def plain_llama(self) -> bool:
    """Exactly a Llama/Mixtral: what Hugging Face export and GPTQ calibration assume."""
    return (self.llama_shaped and self.arch == "decoder" and self.position == "rope"
            and self.mlp_activation == "swiglu" and not self.attention_scale
            and not self.gemma_features)

  def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
    if not self.llama_shaped:
      # The registry builds the abstract model from this config, so it cannot be imported here.
      raise ValueError(f"num_params() is the closed form for Llama-shaped decoders; for "
                       f"arch={self.arch!r} (norm_position={self.norm_position!r}) count the "
                       f"model's arrays with models.param_count(cfg)")
    d, h = self.d_model, self.head_dim
    attn = d * h * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * h * d
    if self.mla:
      n, r, c, q = self.num_heads, self.rope_head_dim, self.kv_lora_rank, self.q_lora_rank
      attn = ((d * q + q + q * n * (h + r)) if q else d * n * (h + r)) + d * (c + r) + c
      attn += c * n * (h + self.value_dim) + n * self.value_dim * d
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * h
    if self.qk_norm_full:
      attn += (self.num_heads + self.num_kv_heads) * h
    per_layer = attn + self.mlp_params(active) + (4 if self.sandwich_norms else 2) * d
    n = self.num_layers * per_layer + d
    if self.first_dense_layers:  # those blocks' dense MLP in place of the experts
      dense = self.dense_config
      n += self.first_dense_layers * (dense.mlp_params() - self.mlp_params(active))
    if include_embedding:
      n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
    elif not self.tie_embeddings:
      n += self.vocab_size * d  # the unembedding is a real matmul
    return n
