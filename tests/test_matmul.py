"""models/matmul.py: the flat 2-D form of a projection equals the einsum, values and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig
from models import matmul
from models.config import ConfigError

# Every projection spec the models use, with small shapes of odd sizes.
SPECS = [
    ("BTD,DF->BTF", (2, 3, 5), (5, 7)),
    ("BTF,FD->BTD", (2, 3, 7), (7, 5)),
    ("BTD,DNH->BTNH", (2, 3, 5), (5, 4, 3)),
    ("BTD,DKH->BTKH", (2, 3, 5), (5, 2, 3)),
    ("BTNH,NHD->BTD", (2, 3, 4, 3), (4, 3, 5)),
    ("BTD,VD->BTV", (2, 3, 5), (11, 5)),
    ("BTD,DV->BTV", (2, 3, 5), (5, 11)),
]


def _arrays(xs, ws, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal(xs), dtype), jnp.asarray(rng.standard_normal(ws), dtype))


@pytest.mark.parametrize("spec,xs,ws", SPECS)
def test_flat_equals_einsum_forward_and_gradients(spec, xs, ws):
  x, w = _arrays(xs, ws)

  def loss(x, w, form):  # a nonlinear loss, so the cotangent is not uniform
    return jnp.sum(jnp.sin(matmul.einsum(spec, x, w, form)))

  flat, ref = matmul.einsum(spec, x, w, "flat"), jnp.einsum(spec, x, w)
  assert flat.shape == ref.shape and flat.dtype == ref.dtype
  np.testing.assert_allclose(flat, ref, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.grad(loss, (0, 1))(x, w, "flat"), jax.grad(loss, (0, 1))(x, w, "einsum")):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_preferred_element_type_and_bfloat16_gradients():
  x, w = _arrays((2, 3, 8), (8, 16), jnp.bfloat16)
  y = matmul.einsum("BTD,DV->BTV", x, w, "flat", preferred_element_type=jnp.float32)
  ref = jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
  gx, gw = jax.grad(lambda x, w: jnp.sum(matmul.einsum(
      "BTD,DV->BTV", x, w, "flat", preferred_element_type=jnp.float32) ** 2), (0, 1))(x, w)
  rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.einsum(
      "BTD,DV->BTV", x, w, preferred_element_type=jnp.float32) ** 2), (0, 1))(x, w)
  assert gx.dtype == gw.dtype == jnp.bfloat16
  np.testing.assert_allclose(gx.astype(jnp.float32), rx.astype(jnp.float32), rtol=2e-2)
  np.testing.assert_allclose(gw.astype(jnp.float32), rw.astype(jnp.float32), rtol=2e-2)


def test_the_weight_gradient_is_a_plain_matmul():
  """The point of the flat form: no dot contracts a transposed operand's leading dimension."""
  x, w = _arrays((4, 64, 32), (32, 128))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(matmul.einsum("BTD,DV->BTV", x, w, "flat") ** 2),
                          (0, 1)))
  hlo = grad.lower(x, w).compile().as_text()
  dots = re.findall(r"lhs_contracting_dims=\{(\d+)\}", hlo)
  assert dots and all(d == "1" for d in dots), dots
  # The einsum form is what this avoids: its weight gradient contracts dimension 0 of x.
  grad_einsum = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.einsum("BTD,DV->BTV", x, w) ** 2),
                                 (0, 1)))
  assert "lhs_contracting_dims={0}" in grad_einsum.lower(x, w).compile().as_text()


def test_auto_is_flat_only_on_a_one_device_cpu():
  one_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
  assert matmul.use_flat("auto") == one_cpu
  assert matmul.use_flat("flat") and not matmul.use_flat("einsum")


@pytest.mark.parametrize("spec,xs,ws,words", [
    ("BTD,DF->BTG", (2, 3, 4), (4, 5), "does not fit"),
    ("BTT,TF->BF", (2, 3, 3), (3, 5), "does not fit"),  # a letter twice in one operand
    ("BTD,EF->BTF", (2, 3, 4), (4, 5), "not a projection"),
    ("BTD,BDF->BTF", (2, 3, 4), (2, 4, 5), "not a projection"),
    ("BTD,DF->BTF", (2, 3, 4), (6, 5), "is 4 in x but 6 in w"),
])
def test_a_spec_that_is_not_a_projection_is_refused(spec, xs, ws, words):
  with pytest.raises(ValueError, match=words):
    matmul.einsum(spec, jnp.zeros(xs), jnp.zeros(ws), "flat")


def test_the_config_names_the_choices():
  with pytest.raises(ConfigError, match="model.matmul='fast'"):
    ModelConfig(matmul="fast")
  assert ModelConfig().matmul == "auto"
