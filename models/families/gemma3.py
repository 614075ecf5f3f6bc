"""Gemma 3, text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's block with an RMSNorm
(1 + w) over each head's query and key in place of score soft-capping, five local layers to
one global by default, and separate RoPE bases: global layers rope_theta (with its scaling),
local ones rope_local_base_freq, unscaled."""

from models import rope as rope_lib
from models.families import base, gemma2


def _normalize(hf: dict, source: str) -> dict:
  """transformers 5's rope_parameters per layer type -> the global layers' as the top-level
  rope_parameters, and the local base as rope_local_base_freq (transformers 4's keys)."""
  rope = hf.get("rope_parameters") or {}
  if "full_attention" not in rope and "sliding_attention" not in rope:
    return hf
  local = rope.get("sliding_attention") or {}
  if local.get("rope_type", "default") != "default":
    raise ValueError(f"{source}: local layers' rope_type={local['rope_type']!r} is not supported;"
                     " only 'default'")
  out = {**hf, "rope_parameters": rope.get("full_attention") or {}}
  if "rope_theta" in local:
    out["rope_local_base_freq"] = local["rope_theta"]
  return out


def _values(hf, get, source):
  values = gemma2.gemma_values(hf, get, source, every=get("sliding_window_pattern"))
  local = float(get("rope_local_base_freq")) if values["layer_pattern"] else 0.0
  return {**values, "qk_norm": True, "rope_local_theta": local}


def _to_hf(cfg, hf):
  out = gemma2.gemma_hf(cfg, hf)
  full = rope_lib.to_hf(cfg.rope, cfg.rope_theta)
  # Without a local base, local layers run the global RoPE, scaling included (models/layers.py).
  local = ({"rope_type": "default", "rope_theta": cfg.rope_local_theta}
           if cfg.rope_local_theta else dict(full))
  out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
  return out


GEMMA3 = base.register(base.Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    defaults=dict(rope_theta=1e6, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, num_key_value_heads=4, head_dim=256,
                  query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                  tie_word_embeddings=True),
    values=_values,
    claims=lambda cfg: gemma2.gemma_shaped(cfg) and cfg.qk_norm,
    to_hf=_to_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **gemma2.NORMS, **base.DENSE_MLP, **base.QK_NORM},
    normalize=_normalize))
