"""Integer matmuls (-a8 formats, W8A8 / W4A8): QArray.int_matmul_groups against float64
references computed from the same quantized activations, and the error bound against the
float product."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.quant import quantize_model
from infer.quant.quantize import encode, to_qarray
from models.config import ModelConfig
from models.quant import default_rules, parse_format, quant_plan
from models.quant.qarray import to_matrix
from models.transformer import Transformer

A8 = ["int8-a8", "int8-g32-a8", "int4-g32-a8", "int4-g32-zp-a8", "int4-g64-asym-a8"]
# (letters, contracted, dims): contraction-major, two contracted letters, output-major (an
# embedding table as the LM head)
LAYOUTS = [("DNH", "D", (128, 4, 24)), ("NHD", "NH", (4, 32, 80)), ("VD", "D", (72, 128))]
SPECS = {"DNH": "BD,DNH->BNH", "NHD": "BNH,NHD->BD", "VD": "BD,VD->BV"}


def _case(name, letters, in_letters, dims, rows, seed=0):
  fmt = parse_format(name)
  rng = np.random.default_rng(seed)
  w = (rng.standard_t(4, dims) * 0.05).astype(np.float32)
  q = to_qarray(encode(to_matrix(w, letters, in_letters), fmt), fmt, letters, in_letters, dims)
  k = int(np.prod([dims[letters.index(c)] for c in in_letters]))
  x_shape = (rows,) + tuple(dims[letters.index(c)] for c in in_letters)
  x = rng.standard_normal(x_shape).astype(np.float32)
  x[0, ...] *= 3  # rows of different ranges
  return fmt, q, x, k


def _quantized_activations(x_NK, groups):
  """What the integer path multiplies: x per row and group as s * q, q in [-127, 127]."""
  x_NGg = x_NK.reshape(x_NK.shape[0], groups, -1)
  s = np.max(np.abs(x_NGg), axis=-1, keepdims=True) / np.float32(127)
  s = np.where(s == 0, np.float32(1), s).astype(np.float32)
  q = np.clip(np.rint(x_NGg / s), -127, 127)
  return (q * s).reshape(x_NK.shape).astype(np.float64), (s / 2).reshape(x_NK.shape[0], groups)


@pytest.mark.parametrize("name", A8)
@pytest.mark.parametrize("letters,in_letters,dims", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5])
def test_integer_matmul_equals_the_float_product_of_the_quantized_operands(
    name, letters, in_letters, dims, rows):
  """Given the quantized activations, the int32 dot and its scales are exact up to float32
  rounding: within 1e-5 of the output's scale of a float64 product of the same operands.
  Against the unquantized activations, every output is within half a step of each
  activation group times the weights' absolute sum over that group."""
  fmt, q, x, k = _case(name, letters, in_letters, dims, rows)
  spec = SPECS[letters]
  got = np.asarray(q.einsum(spec, jnp.asarray(x), jnp.float32), np.float64)
  w_KM = to_matrix(np.asarray(q.dequantize(), np.float64), letters, in_letters)
  groups = k // fmt.group_for(k)
  xq_NK, half_step_NG = _quantized_activations(x.reshape(rows, k), groups)
  want = (xq_NK @ w_KM).reshape(got.shape)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  exact = (x.reshape(rows, k).astype(np.float64) @ w_KM).reshape(got.shape)
  w_GgM = np.abs(w_KM).reshape(groups, -1, w_KM.shape[1]).sum(axis=1)
  bound = (half_step_NG @ w_GgM).reshape(got.shape) * (1 + 1e-5)
  assert np.all(np.abs(got - exact) <= bound + 1e-6), np.max(np.abs(got - exact) - bound)
  assert np.max(np.abs(got - exact)) > 0  # the activations really were quantized


def test_a8_names_codes_and_refusals():
  for name in A8:
    assert parse_format(name).name == name and parse_format(name).act8
  assert parse_format("int8").act8 is False
  _, q, _, _ = _case("int8-a8", "DNH", "D", (128, 4, 24), 1)
  assert q.codes.dtype == jnp.int8  # the integer dot's operand, stored as such
  _, q, _, _ = _case("int4-g32-a8", "DNH", "D", (128, 4, 24), 1)
  assert q.codes.dtype == jnp.uint8  # nibbles, unpacked as they are multiplied
  for bad in ("int8-asym-a8", "int8-zp-a8"):
    with pytest.raises(ValueError, match="symmetric INT8"):
      parse_format(bad)
  with pytest.raises(ValueError, match="-a8"):
    parse_format("int4-g32-a4")


def test_a8_model_runs_close_to_its_weight_only_twin():
  """A tiny model quantized int4-g32-a8 ('auto': its tied embedding at weight-only int8) gives logits
  within 3% of their range of the same weights multiplied in float."""
  cfg = ModelConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=32, mlp_dim=256, tie_embeddings=True)
  tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size
  a8, w4 = Transformer(cfg, nnx.Rngs(0)), Transformer(cfg, nnx.Rngs(0))
  plan = quantize_model(a8, default_rules("int4-g32-a8", "auto"))
  assert {f.name for f in plan.values()} == {"int4-g32-a8", "int8"}
  assert plan["embed_VD"].name == "int8"
  quantize_model(w4, default_rules("int4-g32", "auto"))
  got, want = np.asarray(a8(tokens)), np.asarray(w4(tokens))
  assert np.abs(got - want).max() <= 0.03 * (want.max() - want.min())
  fresh = Transformer(cfg, nnx.Rngs(0))
  assert quant_plan(fresh, default_rules("int8-a8", "auto"))["embed_VD"].name == "int8"
  assert quant_plan(fresh, default_rules("int8-a8", "same"))["embed_VD"].name == "int8-a8"
