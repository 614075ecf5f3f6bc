"""Gemma 2 (Gemma2ForCausalLM): embeddings scaled by sqrt(d), RMSNorm times (1 + w), norms
before and after attention and the MLP, tanh-GELU gating, a query scale of its own
(query_pre_attn_scalar), soft-capped attention scores and logits, and alternating local
(sliding-window) and global layers. models/families/gemma3.py builds on it."""

from models.families import base

# Our norms -> Gemma's four per layer: attn_norm is the input norm, mlp_norm the
# pre-feedforward one; Gemma's post_attention_layernorm follows attention, as ours does.
NORMS = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", 0),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", 0),
}
_KINDS = {"sliding_attention": "L", "full_attention": "G"}


def layer_pattern(hf: dict, source: str, every: int) -> str:
  """layer_types as ModelConfig.layer_pattern, its shortest period; without them (transformers
  4), one global layer in `every`."""
  types = hf.get("layer_types")
  if not types:
    return "L" * (every - 1) + "G"
  unknown = sorted(set(types) - set(_KINDS))
  if unknown:
    raise ValueError(f"{source}: layer_types {unknown} are not supported; only {list(_KINDS)}")
  kinds = "".join(_KINDS[t] for t in types)
  period = next(p for p in range(1, len(kinds) + 1)
                if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
  return kinds[:period]


def gemma_values(hf: dict, get, source: str, every: int) -> dict:
  """The values Gemma 2 and 3 share."""
  base.refuse_keys(hf, source, ("attention_bias", "use_bidirectional_attention"))
  base.check_activation(hf, source, ("gelu_pytorch_tanh",), "hidden_activation")
  window = get("sliding_window") or 0
  pattern = layer_pattern(hf, source, every)
  if "L" in pattern and not window:
    raise ValueError(f"{source}: sliding layers in layer_types but sliding_window="
                     f"{hf.get('sliding_window')!r}")
  return dict(mlp_activation="geglu", embed_scale=True, norm_offset=1.0, sandwich_norms=True,
              attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
              sliding_window=int(window) if "L" in pattern else 0,
              layer_pattern=pattern if "L" in pattern else "",
              attn_softcap=float(get("attn_logit_softcapping") or 0.0),
              final_softcap=float(get("final_logit_softcapping") or 0.0))


def gemma_hf(cfg, hf: dict) -> dict:
  """The config.json keys Gemma 2 and 3 share."""
  kinds = ["sliding_attention" if cfg.local_layer(i) else "full_attention"
           for i in range(cfg.num_layers)]
  scalar = cfg.scale ** -2  # transformers keeps it an integer
  if abs(scalar - round(scalar)) > 1e-6 * scalar:
    raise ValueError(f"cannot export as Gemma: model.attention_scale={cfg.attention_scale} is not"
                     " an integer's inverse square root (query_pre_attn_scalar is an integer)")
  return {**hf, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "query_pre_attn_scalar": int(round(scalar)),
          # transformers builds the sliding mask even with no sliding layer: never null
          "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": kinds,
          "attn_logit_softcapping": cfg.attn_softcap or None,
          "final_logit_softcapping": cfg.final_softcap or None, "attention_bias": False}


def gemma_shaped(cfg) -> bool:
  """Gemma's block: what Gemma 2 and 3 add to."""
  return (cfg.mlp_activation == "geglu" and cfg.sandwich_norms and cfg.norm_offset == 1.0
          and cfg.embed_scale and not cfg.is_moe and not cfg.qkv_bias and cfg.norm == "rms")


GEMMA2 = base.register(base.Family(
    model_type="gemma2", architecture="Gemma2ForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
                  num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                  sliding_window=4096, tie_word_embeddings=True, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0),
    values=lambda hf, get, source: gemma_values(hf, get, source, every=2),
    claims=lambda cfg: gemma_shaped(cfg) and not cfg.qk_norm and not cfg.rope_local_theta,
    to_hf=gemma_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **NORMS, **base.DENSE_MLP}))
