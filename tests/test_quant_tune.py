"""Scale tuning after quantization (infer/quant/tune.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.quant import QArray, default_rules
from infer.quant import quantize_model
from models.quant.rules import params_by_path
from infer.quant.tune import tune_scales
from models.config import ModelConfig
from models.transformer import Transformer

CFG = ModelConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, mlp_dim=256, tie_embeddings=True)


def _kl(student, teacher, ids):
  import jax
  s = jax.nn.log_softmax(student(ids), -1)
  t = jax.nn.log_softmax(teacher(ids), -1)
  return float(jnp.mean(jnp.sum(jnp.exp(t) * (t - s), -1)))


def test_tuning_scales_brings_the_quantized_model_closer_to_the_float_one(fmt="int4-g32"):
  """Only the float16 scales move (codes stay; symmetric INT4 scales keep their signs); the
  KL to the float model falls on the calibration text and on text it never saw.
  (Zero-point formats: tests/test_quant_checkpoint.py, through `meshlm quantize`.)"""
  teacher = Transformer(CFG, nnx.Rngs(0))
  model = Transformer(CFG, nnx.Rngs(0))
  quantize_model(model, default_rules(fmt))
  before = {p: v[...] for p, v in params_by_path(model).items() if isinstance(v[...], QArray)}
  rng = np.random.default_rng(0)
  calib, held = rng.integers(0, 256, (32, 33)), jnp.asarray(rng.integers(0, 256, (16, 32)))
  kl_calib, kl_held = _kl(model, teacher, jnp.asarray(calib[:, :-1])), _kl(model, teacher, held)
  out = tune_scales(model, teacher, calib, epochs=2, batch=8, lr=1e-2)
  assert out["steps"] == 8 and len(out["kl"]) == 8
  after = {p: v[...] for p, v in params_by_path(model).items() if isinstance(v[...], QArray)}
  assert sorted(after) == sorted(before)
  for p, q in after.items():
    np.testing.assert_array_equal(q.codes, before[p].codes)
    if q.offset is not None:
      np.testing.assert_array_equal(q.offset, before[p].offset)
    assert q.scale.dtype == jnp.float16 and (q.scale != before[p].scale).any(), p
    np.testing.assert_array_equal(jnp.sign(q.scale), jnp.sign(before[p].scale))
  assert _kl(model, teacher, jnp.asarray(calib[:, :-1])) < 0.8 * kl_calib
  assert _kl(model, teacher, held) < kl_held


def test_tuning_refuses_a_float_model_and_bad_settings():
  model, teacher = Transformer(CFG, nnx.Rngs(0)), Transformer(CFG, nnx.Rngs(0))
  ids = np.zeros((8, 16), np.int32)
  with pytest.raises(ValueError, match="needs a quantized model"):
    tune_scales(model, teacher, ids, batch=4)
  quantize_model(model, default_rules("int8"))
  with pytest.raises(ValueError, match="N >= batch=16"):
    tune_scales(model, teacher, ids, batch=16)
  with pytest.raises(ValueError, match="epochs=0"):
    tune_scales(model, teacher, ids, batch=4, epochs=0)
