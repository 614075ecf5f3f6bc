"""Qwen3 (Qwen3ForCausalLM): Llama plus an RMSNorm over each head's query and key, before
RoPE (model.qk_norm); head_dim need not be hidden / heads."""

from models.families import base

QWEN3 = base.register(base.Family(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  num_key_value_heads=32, head_dim=128),
    values=lambda hf, get, source: (base.llama_checks(hf, source, base.unused_window)
                                    or dict(qk_norm=True)),
    claims=lambda cfg: (base.dense_llama(cfg) and cfg.qk_norm and not cfg.qkv_bias
                        and not cfg.sliding_window),
    to_hf=lambda cfg, hf: {**hf, "use_sliding_window": False, "sliding_window": None,
                           "max_window_layers": cfg.num_layers, "attention_bias": False},
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.DENSE_MLP, **base.QK_NORM}))
