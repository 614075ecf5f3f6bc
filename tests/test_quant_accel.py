"""QArray's weight-only matmul for accelerators (`scaled_matmul_groups`: codes converted inside
the dot, scales on its output) equals the CPU path's (dequantize, then the dot) and the float
product of the dequantized weight, for every storage layout and format."""

import jax.numpy as jnp
import numpy as np
import pytest

from infer.quant.quantize import encode, to_qarray
from models.quant import parse_format
from models.quant.qarray import to_matrix

FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g32-zp", "int4-g64-asym", "int4-g32-asym"]
# contraction-major, two contracted letters, output-major (an embedding table as LM head)
LAYOUTS = [("DNH", "D", (128, 4, 24)), ("NHD", "NH", (4, 32, 80)), ("VD", "D", (72, 128))]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("letters,in_letters,dims", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5])
def test_scaled_dot_equals_the_dequantized_product(name, letters, in_letters, dims, rows):
  fmt = parse_format(name)
  rng = np.random.default_rng(0)
  w = (rng.standard_t(4, dims) * 0.05).astype(np.float32)
  q = to_qarray(encode(to_matrix(w, letters, in_letters), fmt), fmt, letters, in_letters, dims)
  groups = q.scale.shape[-1 if q.out_first else 0]
  x_NK = rng.standard_normal((rows, q.k)).astype(np.float32)
  x_NGg = jnp.asarray(x_NK.reshape(rows, groups, -1))
  got = np.asarray(q.scaled_matmul_groups(x_NGg, jnp.float32))
  cpu = np.asarray(q.matmul_groups(x_NGg, jnp.float32, jnp.float32))
  w_KM = to_matrix(np.asarray(q.dequantize(jnp.float32)), letters, in_letters)
  want = x_NK.astype(np.float64) @ np.asarray(w_KM, np.float64)
  scale = np.max(np.abs(want))
  assert got.shape == (rows, q.m)
  np.testing.assert_allclose(got, cpu, rtol=0, atol=2e-5 * scale)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
