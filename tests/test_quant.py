"""Quantization formats, QArray matmuls, rules and GPTQ (infer/quant/)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.quant import QArray, default_rules, parse_format, quant_plan
from infer.quant import quantize_model
from models.quant.formats import pack_int4, unpack_int4
from infer.quant.gptq import gptq
from infer.quant.quantize import decode, encode, to_qarray
from models.quant.rules import params_by_path
from models.config import ModelConfig
from models.transformer import Transformer

FORMATS = ["int8", "int8-asym", "int8-zp", "int8-g32", "int4-g32", "int4-g64", "int4-g128",
           "int4-g32-asym", "int4-g128-asym", "int4-g32-zp", "int4-g128-zp"]
CFG = ModelConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, mlp_dim=256, tie_embeddings=True)


def _weights(k=256, m=96, seed=0):
  rng = np.random.default_rng(seed)
  # Heavy-ish tails and a few outliers, as real weights have.
  w = rng.standard_t(4, (k, m)).astype(np.float32) * 0.02
  w[rng.integers(0, k, 8), rng.integers(0, m, 8)] *= 20
  return w


def test_pack_unpack_round_trips_exactly():
  rng = np.random.default_rng(0)
  u = rng.integers(0, 16, (5, 32, 7)).astype(np.uint8)
  packed = pack_int4(u)
  assert packed.shape == (5, 16, 7) and packed.dtype == np.uint8
  np.testing.assert_array_equal(unpack_int4(packed), u)
  np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), jnp)), u)
  with pytest.raises(ValueError, match="0, 15"):
    pack_int4(u + 16)


@pytest.mark.parametrize("name", FORMATS)
def test_round_to_nearest_error_within_its_bound(name):
  fmt = parse_format(name)
  w = _weights()
  codes, scale, offset = encode(w, fmt)
  dequant = decode(codes, scale, offset, fmt)
  err = np.abs(dequant - w)
  g = fmt.group_for(w.shape[0])
  step = np.abs(np.repeat(scale, g, axis=0))
  # Half a quantization step, plus float32 rounding of w/scale and back (a few ulps of |w|).
  bound = 0.5 * step + 4 * np.finfo(np.float32).eps * np.abs(w)
  if fmt.bits == 4 and fmt.symmetric:
    # Q4_0's rule: the extreme maps to code -8 (to float16 rounding of the scale), and the
    # other sign clips at +7 steps: beyond 7.5 steps the error is |w| - 7 steps (< 1 step).
    bound = np.maximum(bound, np.abs(w) - 7 * step + 4 * np.finfo(np.float32).eps * np.abs(w))
    extreme = np.abs(w.reshape(-1, g, w.shape[1])).argmax(axis=1)
    w_ext = np.take_along_axis(w.reshape(-1, g, w.shape[1]), extreme[:, None], 1)
    d_ext = np.take_along_axis(dequant.reshape(-1, g, w.shape[1]), extreme[:, None], 1)
    np.testing.assert_allclose(d_ext, w_ext, rtol=2.0 ** -10)
    assert (bound < step + 1e-6).all()
  assert (err <= bound).all(), float((err - bound).max())
  # Unsigned codes within the format's range (symmetric INT8 never uses 0: q >= -127).
  assert codes.dtype == np.uint8 and codes.max() < (16 if fmt.bits == 4 else 256)
  if fmt.bits == 8 and fmt.symmetric:
    assert codes.min() >= 1
  if fmt.int_zero:   # the offset is an integer code, stored in one byte per group
    assert (offset == np.rint(offset)).all() and 0 <= offset.min() and offset.max() < fmt.levels
    q = to_qarray((codes, scale, offset), fmt, "DV", "D", w.shape)
    packed = codes.size // (2 if fmt.bits == 4 else 1)
    assert q.offset.dtype == jnp.uint8 and q.nbytes == packed + 3 * scale.size


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_matmul_equals_dequantize_then_matmul(name):
  fmt = parse_format(name)
  rng = np.random.default_rng(1)
  w_DNH = _weights(128, 4 * 32).reshape(128, 4, 32)
  q = to_qarray(encode(w_DNH.reshape(128, -1), fmt), fmt, "DNH", "D", w_DNH.shape)
  x_BTD = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
  dense = q.dequantize()
  assert dense.shape == w_DNH.shape
  want = jnp.einsum("BTD,DNH->BTNH", x_BTD, dense)
  got = q.einsum("BTD,DNH->BTNH", x_BTD, jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Contracting two letters (the attention output projection) and a row lookup (embeddings).
  w_NHD = _weights(4 * 32, 128, seed=2).reshape(4, 32, 128)
  q = to_qarray(encode(w_NHD.reshape(-1, 128), fmt), fmt, "NHD", "NH", w_NHD.shape)
  x_BTNH = jnp.asarray(rng.standard_normal((2, 3, 4, 32)), jnp.float32)
  np.testing.assert_allclose(q.einsum("BTNH,NHD->BTD", x_BTNH, jnp.float32),
                             jnp.einsum("BTNH,NHD->BTD", x_BTNH, q.dequantize()),
                             rtol=1e-5, atol=1e-5)
  w_VD = _weights(128, 50, seed=3).T
  q = to_qarray(encode(w_VD.T, fmt), fmt, "VD", "D", w_VD.shape)
  ids = jnp.asarray([[0, 49, 7], [7, 3, 1]])
  np.testing.assert_array_equal(q.take(ids, jnp.float32), jnp.take(q.dequantize(), ids, axis=0))
  x_BTD = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
  np.testing.assert_allclose(q.einsum("BTD,VD->BTV", x_BTD, jnp.float32),
                             jnp.einsum("BTD,VD->BTV", x_BTD, q.dequantize()), rtol=1e-5, atol=1e-5)


def test_auto_embeddings_stay_int8_under_int4():
  """`auto` (meshlm quantize's default): the embedding/LM head at INT8 under INT4 formats,
  like the projections otherwise; `same` puts it in the projections' format."""
  model = Transformer(CFG, nnx.Rngs(0))
  names = lambda rules: {p: f.name for p, f in quant_plan(model, rules).items()}  # noqa: E731
  for fmt, emb in [("int4-g32", "int8"), ("int4-g32-zp", "int8"), ("int8", "int8"),
                   ("int8-asym", "int8-asym")]:
    auto = names(default_rules(fmt, "auto"))
    assert auto.pop("embed_VD") == emb and set(auto.values()) == {fmt}, (fmt, auto)
  assert set(names(default_rules("int4-g32", "same")).values()) == {"int4-g32"}


def test_quantized_model_matches_its_dequantized_weights():
  tokens = jnp.arange(24).reshape(2, 12) % CFG.vocab_size
  model = Transformer(CFG, nnx.Rngs(0))
  float_bytes = sum(v[...].nbytes for v in params_by_path(model).values())
  plan = quantize_model(model, default_rules("int4-g32"))
  assert set(plan) == {"embed_VD", "blocks/attn/wq_DNH", "blocks/attn/wk_DKH",
                       "blocks/attn/wv_DKH", "blocks/attn/wo_NHD", "blocks/mlp/gate_DF",
                       "blocks/mlp/up_DF", "blocks/mlp/down_FD"}
  twin = Transformer(CFG, nnx.Rngs(0))
  twin_params = params_by_path(twin)
  for path, var in params_by_path(model).items():
    if isinstance(var[...], QArray):
      q = var[...]
      # Layer weights keep the layer axis; the embedding table is stored output-major.
      if path.startswith("blocks/"):
        assert q.codes.shape[0] == CFG.num_layers and q.codes.shape[2] == 16, q.codes.shape
      else:
        assert q.codes.shape == (CFG.vocab_size, CFG.d_model // 32, 16), q.codes.shape
      assert q.codes.dtype == jnp.uint8
      twin_params[path].set_value(var[...].dequantize())
  np.testing.assert_allclose(model(tokens), twin(tokens), rtol=1e-5, atol=1e-5)
  from infer.quant import weight_bytes
  # int4-g32 with float16 scales: 4 + 16/32 = 4.5 bits a weight; norms stay float.
  assert weight_bytes(model) < 0.15 * float_bytes


def test_bad_group_and_format_are_refused_naming_the_layer():
  model = Transformer(CFG, nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"blocks/mlp/down_FD.*group size 96.*256"):
    quant_plan(model, [("down_FD", "int4-g96")])
  with pytest.raises(ValueError, match="unknown quantization format 'int3-g64'"):
    quant_plan(model, [(".*", "int3-g64")])
  with pytest.raises(ValueError, match="INT4 needs a group size"):
    parse_format("int4")
  with pytest.raises(ValueError, match="match no quantizable parameter"):
    quant_plan(model, [("attn_norm", "int8")])
  # fit_groups halves a group until it divides, and says so in the plan.
  plan = quant_plan(model, [("down_FD", "int4-g512")], fit_groups=True)
  assert plan["blocks/mlp/down_FD"].name == "int4-g256"
  quantize_model(model, [("wq_DNH", "int8")])
  with pytest.raises(ValueError, match="wq_DNH is already quantized"):
    quant_plan(model, [("wq_DNH", "int8")])
  with pytest.raises(TypeError, match="only w"):
    params_by_path(model)["blocks/attn/wq_DNH"][...][0]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-asym", "int4-g64-zp", "int8"])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(name, act_order):
  fmt = parse_format(name)
  rng = np.random.default_rng(0)
  x_NK = rng.standard_normal((2048, 128)) @ rng.standard_normal((128, 128)) * 0.3
  w = _weights(128, 64)
  h = 2 * x_NK.T @ x_NK / len(x_NK)
  rtn = np.linalg.norm(x_NK @ (decode(*encode(w, fmt), fmt) - w))
  codes, scale, offset = gptq(w, h, fmt, act_order=act_order)
  got = np.linalg.norm(x_NK @ (decode(codes, scale, offset, fmt) - w))
  assert got < 0.9 * rtn, (got, rtn)
  if act_order:  # a different order of rows, so different codes
    assert (codes != gptq(w, h, fmt)[0]).any()


@pytest.mark.parametrize("name", ["int4-g32", "int4-g32-zp"])
def test_clip_search_weighted_by_the_inputs_lowers_the_output_error(name):
  """Given each group's block of H, the clipping search minimises the output error
  dᵀHd, not |d|²: on inputs with a few loud channels it finds a lower output error."""
  from models.quant.formats import dequantize_values, quantize_values, scales_for
  fmt = parse_format(name)
  rng = np.random.default_rng(3)
  x_NK = rng.standard_normal((4096, 128))
  x_NK[:, rng.choice(128, 6, replace=False)] *= 30.0
  h = 2 * x_NK.T @ x_NK / len(x_NK)
  w_GgM = _weights(128, 64).reshape(4, 32, 64)
  h_Ggg = np.stack([h[i:i + 32, i:i + 32] for i in range(0, 128, 32)])

  def out_err(h_blocks):
    s, o = scales_for(w_GgM, fmt, True, h_blocks)
    o = None if o is None else o[:, None]
    d = dequantize_values(quantize_values(w_GgM, s[:, None], o, fmt), s[:, None], o, fmt)
    return np.einsum("Ggm,Ggh,Ghm->Gm", d - w_GgM, h_Ggg, d - w_GgM)

  weighted, plain = out_err(h_Ggg), out_err(None)
  assert (weighted <= plain * (1 + 1e-9)).all() and weighted.sum() < 0.8 * plain.sum(), (
      weighted.sum(), plain.sum())


def test_large_weights_multiply_in_column_slices(monkeypatch):
  import models.quant.qarray as qarray
  fmt = parse_format("int4-g32-asym")
  x_BTD = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 64)), jnp.float32)
  cases = [("VD", 96, (6, 16)),   # output-major, equal slices
           ("VD", 97, (5, 19)),   # 97 is prime: five slices and a tail of two outputs
           ("DV", 96, (6, 16))]   # contraction-major: slices cut the last axis
  for letters, m, slices in cases:
    w_KM = _weights(64, m, seed=m)
    w = w_KM.T if letters == "VD" else w_KM
    q = to_qarray(encode(w_KM, fmt), fmt, letters, "D", w.shape)
    assert q.out_first == (letters == "VD")
    spec = f"BTD,{letters}->BTV"
    whole = q.einsum(spec, x_BTD, jnp.float32)
    np.testing.assert_allclose(whole, jnp.einsum(spec, x_BTD, q.dequantize()), rtol=1e-5,
                               atol=1e-5)
    with monkeypatch.context() as patch:
      patch.setattr(qarray, "CHUNK_ELEMENTS", 64 * 96 // 5)
      assert qarray._slices(64, m) == slices
      np.testing.assert_allclose(q.einsum(spec, x_BTD, jnp.float32), whole, rtol=1e-6,
                                 atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_gptq_quantize_model_lowers_output_error(tied):
  import dataclasses
  from infer.quant.gptq import gptq_quantize
  cfg = dataclasses.replace(CFG, tie_embeddings=tied)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 32))
  ref = Transformer(cfg, nnx.Rngs(0))(jnp.asarray(ids))
  errors = {}
  for method in ("rtn", "gptq"):
    model = Transformer(cfg, nnx.Rngs(0))
    if method == "rtn":
      plan = quantize_model(model, default_rules("int4-g32"))
    else:
      plan = gptq_quantize(model, default_rules("int4-g32"), ids, batch=4)
    assert len(plan) == (8 if tied else 9) and all(isinstance(v[...], QArray) for p, v in
                                  params_by_path(model).items() if p in plan)
    errors[method] = float(jnp.abs(model(jnp.asarray(ids)) - ref).mean())
  assert errors["gptq"] < errors["rtn"], errors


@pytest.mark.parametrize("name", ["int4-g32", "int4-g128-asym", "int8"])
def test_clip_search_lowers_the_squared_error(name):
  from models.quant.formats import scales_for, quantize_values, dequantize_values
  fmt = parse_format(name)
  w = _weights(256, 64)
  g = fmt.group_for(256)
  w_GgM = w.reshape(256 // g, g, 64)

  def sq_error(search):
    scale, offset = scales_for(w_GgM, fmt, search)
    off = None if offset is None else offset[:, None]
    codes = quantize_values(w_GgM, scale[:, None], off, fmt)
    return ((dequantize_values(codes, scale[:, None], off, fmt) - w_GgM) ** 2).sum()

  # The unshrunk range is in the grid, so never worse; at 16 levels clipping the t-tails wins.
  assert sq_error(True) < sq_error(False) if fmt.bits == 4 else sq_error(True) <= sq_error(False)
