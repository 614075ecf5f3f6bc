"""Phi-3 (Phi3ForCausalLM): Llama with the query, key and value projections stored as one
fused qkv_proj and the MLP's gate and up projections as one gate_up_proj (rows in that
order; models/hf_io.py splits and refuses them), Phi-3-mini's sliding window, and its
128k-context variants' `longrope` scaling (models/rope.py)."""

from models.families import base

_FUSED_NAMES = {
    ("attn", "wq_DNH"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk_DKH"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv_DKH"): ("self_attn.v_proj.weight", 1),
}


def _fused(cfg):
  q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.mlp_dim
  return {"self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", q),
                                         ("self_attn.k_proj.weight", kv),
                                         ("self_attn.v_proj.weight", kv)],
          "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", f), ("mlp.up_proj.weight", f)]}


def _normalize(hf: dict, source: str) -> dict:
  """Phi-3 128k's rope as transformers reads it: "su"/"yarn" mean longrope, and its
  original_max_position_embeddings sits at the top level (default 4096)."""
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  rope = dict(hf.get(key) or {})
  kind = rope.get("rope_type", rope.get("type"))
  if kind not in ("longrope", "su", "yarn"):
    return hf
  rope["rope_type"] = "longrope"
  rope.pop("type", None)
  rope.setdefault("original_max_position_embeddings",
                  hf.get("original_max_position_embeddings") or 4096)
  return {**hf, key: rope}


def _values(hf, get, source):
  base.llama_checks(hf, source, window=lambda hf, source: None)  # any window
  if hf.get("partial_rotary_factor", 1.0) != 1.0:  # transformers 4 kept it at the top level
    raise ValueError(f"{source}: partial_rotary_factor={hf['partial_rotary_factor']} is not "
                     "supported (rotary embeddings over the whole head only)")
  window = get("sliding_window")
  return dict(sliding_window=int(window)) if window else {}


PHI3 = base.register(base.Family(
    model_type="phi3", architecture="Phi3ForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                  num_key_value_heads=None, sliding_window=None),
    values=_values,
    # Exactly a Llama (or, windowed, a Mistral) but for the fused storage: a model exports as
    # Phi-3 only if it was loaded as one (models/families/__init__.py: family_of).
    claims=lambda cfg: (cfg.hf_family == "phi3" and base.dense_llama(cfg) and not cfg.qkv_bias
                        and not cfg.qk_norm),
    to_hf=lambda cfg, hf: {**hf, "sliding_window": cfg.sliding_window or None,
                           "original_max_position_embeddings": cfg.rope_original_max_len
                           if cfg.rope_scaling == "longrope" else cfg.max_seq_len,
                           "attention_bias": False,
                           # transformers' default (32000) would lie outside a smaller vocabulary;
                           # a padding index only stops its embedding's gradient in training
                           "pad_token_id": None},
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.DENSE_MLP},
    normalize=_normalize, fused=_fused))
