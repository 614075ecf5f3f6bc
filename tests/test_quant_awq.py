"""AWQ-style activation-aware scaling (infer/quant/awq.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.quant import default_rules, parse_format, quant_plan
from infer.quant.awq import awq_quantize, awq_scale, rtn_errors, search_scales
from infer.quant.quantize import decode, encode
from models.quant.rules import params_by_path
from models.config import ModelConfig
from models.transformer import Transformer

# GQA (4 query heads read 2 kv heads), so the wv -> wo pair ties scales across heads.
CFG = ModelConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, mlp_dim=256, tie_embeddings=True)


def _outlier_inputs(n=2048, k=128, seed=0):
  """Inputs whose energy sits in a few channels, as LLM activations do (AWQ's premise)."""
  rng = np.random.default_rng(seed)
  x_NK = rng.standard_normal((n, k))
  x_NK[:, rng.choice(k, 6, replace=False)] *= 30.0
  return x_NK


@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-asym", "int4-g64-zp", "int8"])
def test_rtn_errors_match_the_stored_quantizer(name):
  """The jitted search proxy is round-to-nearest as encode/decode store it, up to the float16
  rounding of the scales (≤ 2⁻¹¹ of a step), for unit and non-unit row scales."""
  fmt = parse_format(name)
  rng = np.random.default_rng(1)
  w = (rng.standard_t(4, (128, 48)) * 0.02).astype(np.float32)
  x = _outlier_inputs()
  h = (2 * x.T @ x / len(x)).astype(np.float32)
  s = np.stack([np.ones(128), rng.uniform(0.5, 2.0, 128)]).astype(np.float32)
  got = np.asarray(rtn_errors(jnp.asarray(w), jnp.asarray(h), jnp.asarray(s), fmt))
  for i, s_K in enumerate(s):
    d = decode(*encode(w * s_K[:, None], fmt), fmt) / s_K[:, None] - w
    want = float(np.sum(d * (h @ d)))
    np.testing.assert_allclose(got[i], want, rtol=1e-2)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-asym"])
def test_search_scales_lowers_the_error_on_outlier_channels(name):
  """With a few high-energy input channels, scaling them up before rounding cuts the
  output error by more than a tenth against plain rounding (α = 0)."""
  fmt = parse_format(name)
  x = _outlier_inputs()
  h = 2 * x.T @ x / len(x)
  w = (np.random.default_rng(2).standard_t(4, (128, 64)) * 0.02).astype(np.float32)
  alpha, s_C = search_scales([(w, fmt)], h, np.arange(128))
  plain = np.linalg.norm(x @ (decode(*encode(w, fmt), fmt) - w))
  s_K = s_C[:, None].astype(np.float32)
  scaled = np.linalg.norm(x @ (decode(*encode(w * s_K, fmt), fmt) / s_K - w))
  assert alpha > 0 and scaled < 0.9 * plain, (alpha, scaled, plain)


def model_with_outliers():
  """CFG with a few large channels in each norm scale, so every pair has something to scale."""
  model = Transformer(CFG, nnx.Rngs(0))
  rng = np.random.default_rng(3)
  for path, var in params_by_path(model).items():
    if path.endswith("norm/scale"):
      value = np.array(var[...])
      value[..., rng.choice(value.shape[-1], 4, replace=False)] = 20.0
      var.set_value(jnp.asarray(value))
  return model


def test_awq_scale_leaves_the_float_model_unchanged():
  ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 32)))
  model = model_with_outliers()
  ref = np.asarray(model(ids))
  before = {p: np.array(v[...]) for p, v in params_by_path(model).items()}
  alphas = awq_scale(model, quant_plan(model, default_rules("int4-g32")), ids, batch=4)
  assert set(alphas) == {"attn_norm/scale", "attn/wv_DKH", "mlp_norm/scale", "mlp/up_DF"}
  assert all(len(a) == CFG.num_layers for a in alphas.values())
  changed = [p for p, v in params_by_path(model).items() if not np.array_equal(v[...], before[p])]
  assert any(a > 0 for a in alphas["attn_norm/scale"]) and "blocks/attn_norm/scale" in changed
  np.testing.assert_allclose(np.asarray(model(ids)), ref, rtol=1e-4, atol=1e-4)


def test_awq_quantize_lowers_output_error_against_rtn():
  from infer.quant import quantize_model
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 32))
  ref = model_with_outliers()(jnp.asarray(ids))
  errors = {}
  for method in ("rtn", "awq"):
    model = model_with_outliers()
    if method == "rtn":
      quantize_model(model, default_rules("int4-g32"))
    else:
      awq_quantize(model, default_rules("int4-g32"), ids, batch=4)
    errors[method] = float(jnp.abs(model(jnp.asarray(ids)) - ref).mean())
  assert errors["awq"] < errors["rtn"], errors


def test_awq_refuses_models_it_cannot_fold_into():
  import dataclasses
  model = Transformer(dataclasses.replace(CFG, norm="layer", use_bias=True), nnx.Rngs(0))
  with pytest.raises(ValueError, match="AWQ scaling folds into Llama-style"):
    awq_scale(model, {}, np.zeros((1, 4), np.int32))
