"""Mistral (MistralForCausalLM): Llama with one sliding window on every layer
(model.sliding_window); the Engine's cache is then a ring of twice the window
(infer/kv_cache.py). A config.json without a window is a Llama."""

from models.families import base


def _values(hf, get, source):
  base.llama_checks(hf, source, window=lambda hf, source: None)  # any window
  window = get("sliding_window")
  return dict(sliding_window=int(window)) if window else {}


MISTRAL = base.register(base.Family(
    model_type="mistral", architecture="MistralForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                  num_key_value_heads=8, sliding_window=4096),
    values=_values,
    claims=lambda cfg: (base.dense_llama(cfg) and bool(cfg.sliding_window) and not cfg.qkv_bias
                        and not cfg.qk_norm),
    to_hf=lambda cfg, hf: {**hf, "sliding_window": cfg.sliding_window},
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.DENSE_MLP}))
