"""models/xent.py: the fused chunked unembedding + cross-entropy equals optax's loss on
whole logits, in value and gradients, and training takes it without the [B, T, V] logits."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import run_worker
from models import ConfigError, ModelConfig, create_model
from models import xent
from train.step import forward_loss

B, T, D, V = 3, 12, 16, 53  # odd sizes


def _inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
  w = jnp.asarray(rng.standard_normal((D, V)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  weights = jnp.asarray(rng.integers(0, 2, (B, T)), jnp.float32)  # a mask with zeros in it
  return x, w, targets, weights


def _reference(x, w_DV, targets, weights):
  logits = jnp.matmul(x, w_DV.astype(x.dtype), preferred_element_type=jnp.float32)
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


@pytest.mark.parametrize("chunks", [1, 2, 3, 12, None])
@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("unroll", [False, True])
def test_loss_and_gradients_equal_whole_logits(chunks, vocab_major, unroll):
  x, w_DV, targets, weights = _inputs()
  w = w_DV.T if vocab_major else w_DV

  def fused(x, w):
    return xent.xent_sum(x, w, targets, weights, vocab_major=vocab_major, dtype=jnp.float32,
                         chunks=chunks, unroll=unroll)

  def ref(x, w):
    return _reference(x, w.T if vocab_major else w, targets, weights)

  np.testing.assert_allclose(fused(x, w), ref(x, w), rtol=1e-6)  # primal: loss-only scan
  (loss, grads), (want_loss, want) = (jax.value_and_grad(f, (0, 1))(x, w) for f in (fused, ref))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for got, exp in zip(grads, want):
    assert got.shape == exp.shape and got.dtype == exp.dtype
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
  # Masked positions get no gradient at all.
  assert not np.any(np.asarray(grads[0])[np.asarray(weights) == 0])


def test_the_upstream_cotangent_scales_the_gradients():
  x, w, targets, weights = _inputs()
  f = lambda x, w: 3.0 * xent.xent_sum(x, w, targets, weights, vocab_major=False,
                                       dtype=jnp.float32, chunks=4)
  g = lambda x, w: 3.0 * _reference(x, w, targets, weights)
  for got, exp in zip(jax.grad(f, (0, 1))(x, w), jax.grad(g, (0, 1))(x, w)):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_keeps_float32_accumulation():
  x, w, targets, weights = _inputs(jnp.bfloat16)
  loss, (gx, gw) = jax.value_and_grad(lambda x, w: xent.xent_sum(
      x, w, targets, weights, vocab_major=False, dtype=jnp.bfloat16, chunks=4), (0, 1))(x, w)
  want, (rx, rw) = jax.value_and_grad(lambda x, w: _reference(x, w, targets, weights),
                                      (0, 1))(x, w)
  assert loss.dtype == jnp.float32 and gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
  np.testing.assert_allclose(loss, want, rtol=1e-3)
  np.testing.assert_allclose(gx.astype(jnp.float32), rx.astype(jnp.float32), rtol=3e-2,
                             atol=3e-3)
  np.testing.assert_allclose(gw, rw, rtol=3e-2, atol=3e-3)


@pytest.mark.parametrize("rows, seq, most, want", [
    (1, 8192, None, 16), (2, 8192, None, 32), (4, 16, 8, 8), (1, 37, 8, 37), (3, 12, 1000, 1),
    (1, 1, None, 1), (5, 12, 8, 12)])
def test_num_chunks_is_the_fewest_dividing_the_sequence_within_the_cap(rows, seq, most, want):
  n = xent.num_chunks(rows, seq, most)
  assert n == want and seq % n == 0
  assert rows * seq <= (most or xent.CHUNK_ROWS) * n or n == seq
  assert all(seq % k or rows * seq > (most or xent.CHUNK_ROWS) * k for k in range(1, n))


def test_chunks_that_do_not_divide_the_sequence_are_refused():
  x, w, targets, weights = _inputs()
  with pytest.raises(ValueError, match="5 loss chunks do not divide the sequence length 12"):
    xent.xent_sum(x, w, targets, weights, vocab_major=False, dtype=jnp.float32, chunks=5)


TINY = dict(vocab_size=97, d_model=24, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
            max_seq_len=16)


def _batch(cfg, b=2, t=16):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, cfg.vocab_size, (b, t + 1))
  seg = np.ones((b, t), np.int32)
  seg[1, 11:] = 0  # padding: no loss
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg,
               positions=np.tile(np.arange(t), (b, 1)), loss_mask=(rng.random((b, t)) > 0.2))
  if cfg.arch == "prefix_lm":
    batch["prefix"] = (np.arange(t)[None] < 5).repeat(b, 0)
  return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


@pytest.mark.parametrize("values", [TINY, dict(TINY, tie_embeddings=True),
                                    dict(TINY, arch="prefix_lm")])
def test_training_loss_and_gradients_match_the_logits_path(values, monkeypatch):
  """forward_loss with xent=chunked against xent=logits: same params, same batch."""
  monkeypatch.setattr(xent, "CHUNK_ROWS", 8)  # 4 chunks of 2 rows x 4 positions
  base = ModelConfig(**values, xent="logits")
  model = create_model(base, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  chunked = nnx.split(create_model(dataclasses.replace(base, xent="chunked"), nnx.Rngs(0)))[0]
  assert nnx.merge(chunked, params).chunked_xent() and not model.chunked_xent()
  batch = _batch(base)

  def loss(g, p):
    return forward_loss(g, p, batch)[0]

  got, want = (jax.value_and_grad(loss, 1)(g, params) for g in (chunked, graphdef))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    # Summation order differs (chunked rows), so the bound is float32 rounding relative
    # to each gradient's scale: an entry near zero is a sum of cancelling terms.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
  # The chunked path never builds the whole logits: no [B·T, V] or [B, T, V] value.
  whole = {(32, base.vocab_size), (2, 16, base.vocab_size)}
  jaxpr = jax.make_jaxpr(lambda p: jax.grad(loss, 1)(chunked, p))(params)
  assert not set(_shapes(jaxpr.jaxpr)) & whole, "chunked xent materialised the whole logits"


def _shapes(jaxpr):
  """Output shapes of every equation, inside scans, custom VJPs and jits too."""
  for eqn in jaxpr.eqns:
    yield from (tuple(v.aval.shape) for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr wraps a Jaxpr
        if hasattr(inner, "eqns"):
          yield from _shapes(inner)


def test_whole_logits_unless_chunked_is_asked_for():
  """On a CPU chunking saves memory but no time (docs/results.md), so it is opt-in."""
  assert not create_model(ModelConfig(**TINY), nnx.Rngs(0)).chunked_xent()
  assert create_model(ModelConfig(**TINY, xent="chunked"), nnx.Rngs(0)).chunked_xent()


def test_chunked_on_a_model_without_a_decoder_head_is_refused():
  with pytest.raises(ConfigError, match="xent='chunked' fuses a decoder's unembedding"):
    ModelConfig(**dict(TINY, arch="encoder", num_classes=2), xent="chunked")
  with pytest.raises(ConfigError, match="model.xent='fused'; choose one of"):
    ModelConfig(**TINY, xent="fused")


@pytest.mark.parametrize("layout", ["fsdp", "sequence", "fsdp+tensor"])
def test_sharded_chunks_stay_on_their_devices(layout):
  """On 8 devices (tests/workers/xent_sharded.py) the chunk loop runs over each device's own
  positions: as many trips as one device's chunks, no collective of a chunk's logits (only
  the vocabulary split's row statistics and dx, as for whole logits), the output table
  gathered at most once, and the same loss and gradients as whole logits."""
  facts = json.loads(run_worker("xent_sharded.py", layout).stdout.strip().splitlines()[-1])
  assert facts["chunks"] > 1 and facts["trips"] == [facts["chunks"]], facts
  shapes = [re.findall(r"\[([\d,]*)\]", t) for t, _ in facts["collectives"]]
  logits_like = [s for group in shapes for s in group
                 if len(s.split(",")) >= 3 and int(s.split(",")[-1]) in (320, 160)]
  assert not logits_like, facts["collectives"]
  assert sum(op == "all-gather" for _, op in facts["collectives"]) <= 1, facts["collectives"]
  np.testing.assert_allclose(facts["loss"], facts["want"], rtol=1e-5)
  assert facts["gx_err"] <= 0.02 * facts["gx_scale"] and facts["gw_err"] <= 0.02 * facts["gw_scale"]
