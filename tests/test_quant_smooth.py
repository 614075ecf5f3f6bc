"""SmoothQuant-style smoothing before integer-activation quantization (infer/quant/smooth.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.quant import quantize_model
from infer.quant.quantize import decode, encode
from infer.quant.smooth import search_smoothing, smooth_quantize, smooth_scale
from models.config import ModelConfig
from models.quant import default_rules, parse_format, quant_plan
from models.quant.rules import params_by_path
from models.transformer import Transformer
from test_quant_awq import CFG, model_with_outliers  # GQA, outlier channels in each norm


def _w8a8(x_NK, w_KM, fmt):
  """The integer path's product in float64: per-row absmax int8 activations over the
  format's groups, times the round-to-nearest weight."""
  k = w_KM.shape[0]
  x_NGg = x_NK.reshape(len(x_NK), k // fmt.group_for(k), -1)
  step = np.abs(x_NGg).max(axis=-1, keepdims=True) / 127
  qx = (np.clip(np.rint(x_NGg / step), -127, 127) * step).reshape(x_NK.shape)
  return qx @ decode(*encode(w_KM, fmt), fmt).astype(np.float64)


@pytest.mark.parametrize("name", ["int8-a8", "int4-g32-a8"])
def test_search_smoothing_cuts_the_integer_product_error_on_outlier_channels(name):
  """Six input channels 30x the rest (as LLM activations have) coarsen every token's int8
  step; the chosen smoothing cuts the W8A8 / W4A8 output error to under half of plain
  rounding's, measured here in float64 apart from the search's own float32 proxy."""
  fmt = parse_format(name)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1024, 128)).astype(np.float32)
  x[:, rng.choice(128, 6, replace=False)] *= 30.0
  w = (rng.standard_t(4, (128, 64)) * 0.02).astype(np.float32)
  alpha, s_C = search_smoothing([(w, fmt, "w")], x, np.abs(x).max(axis=0), np.arange(128))
  assert alpha is not None and s_C.shape == (128,)
  exact = x.astype(np.float64) @ w
  plain = np.linalg.norm(_w8a8(x.astype(np.float64), w, fmt) - exact)
  smoothed = np.linalg.norm(_w8a8(x / s_C, w * s_C[:, None], fmt) - exact)
  assert smoothed < 0.5 * plain, (alpha, smoothed, plain)


def test_smooth_scale_leaves_the_float_model_unchanged_and_skips_weight_only_plans():
  ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 32)))
  model = model_with_outliers()
  ref = np.asarray(model(ids))
  alphas = smooth_scale(model, quant_plan(model, default_rules("int8-a8")), ids, batch=4)
  assert set(alphas) == {"attn_norm/scale", "attn/wv_DKH", "mlp_norm/scale", "mlp/up_DF"}
  assert all(len(a) == CFG.num_layers for a in alphas.values())
  assert any(a is not None for a in alphas["attn_norm/scale"])   # the planted outliers
  np.testing.assert_allclose(np.asarray(model(ids)), ref, rtol=0,
                             atol=1e-4 * np.abs(ref).max())
  before = {p: np.array(v[...]) for p, v in params_by_path(model).items()}
  # Weight-only formats quantize no activations: nothing to smooth, nothing touched.
  assert smooth_scale(model, quant_plan(model, default_rules("int8")), ids, batch=4) == {}
  assert all(np.array_equal(v[...], before[p]) for p, v in params_by_path(model).items())


def test_smooth_quantize_beats_round_to_nearest_on_held_out_tokens():
  """int8-a8 on the outlier model: logits closer to the float model's on tokens the
  calibration never saw than plain round-to-nearest's, by more than a fifth."""
  rng = np.random.default_rng(5)
  calib = jnp.asarray(rng.integers(0, CFG.vocab_size, (16, 32)))
  held = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 32)))
  ref = np.asarray(model_with_outliers()(held))
  rtn, smooth = model_with_outliers(), model_with_outliers()
  rules = default_rules("int8-a8", "same")
  quantize_model(rtn, rules)
  plan, _ = smooth_quantize(smooth, rules, calib, batch=8)
  assert {f.name for f in plan.values()} == {"int8-a8"}
  err_rtn = np.linalg.norm(np.asarray(rtn(held)) - ref)
  err_smooth = np.linalg.norm(np.asarray(smooth(held)) - ref)
  assert err_smooth < 0.8 * err_rtn, (err_smooth, err_rtn)


def test_smoothing_refuses_models_it_cannot_fold_into():
  moe = Transformer(ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2,
                                head_dim=16, mlp_dim=64, num_experts=2), nnx.Rngs(0))
  ids = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match="Llama-style dense blocks"):
    smooth_quantize(moe, default_rules("int8-a8"), ids)
