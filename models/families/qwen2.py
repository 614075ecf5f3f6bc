"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama plus biases on the q/k/v projections
(model.qkv_bias); the small ones tie their embeddings."""

from models.families import base

QWEN2 = base.register(base.Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  num_key_value_heads=32),
    values=lambda hf, get, source: (base.llama_checks(hf, source, base.unused_window)
                                    or dict(qkv_bias=True)),
    claims=lambda cfg: (base.dense_llama(cfg) and cfg.qkv_bias and not cfg.qk_norm
                        and not cfg.sliding_window),
    to_hf=lambda cfg, hf: {**hf, "use_sliding_window": False, "sliding_window": None,
                           "max_window_layers": cfg.num_layers},
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.DENSE_MLP, **base.QKV_BIAS}))
