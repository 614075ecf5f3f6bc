"""Model unit tests: causality, packed-document isolation, GQA, scan/remat equivalence, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ConfigError, ModelConfig, Transformer
from models.attention import visible

CFG = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48)


def _model(**kw):
  return Transformer(ModelConfig(**{**CFG, **kw}), nnx.Rngs(0))


def _tokens(b=2, t=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG["vocab_size"], (b, t)), jnp.int32)


def test_future_tokens_never_change_earlier_logits():
  model = _model()
  tokens = _tokens()
  base = model(tokens)
  for cut in (1, 5, 11):
    changed = tokens.at[:, cut:].set((tokens[:, cut:] + 7) % CFG["vocab_size"])
    out = model(changed)
    np.testing.assert_array_equal(np.asarray(out[:, :cut]), np.asarray(base[:, :cut]))
    assert not np.allclose(out[:, cut:], base[:, cut:])


def test_packed_documents_do_not_attend_to_each_other():
  """Row [doc A | doc B] gives the same logits for each doc as running it alone."""
  model = _model()
  doc_a, doc_b = _tokens(1, 5, seed=1), _tokens(1, 7, seed=2)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.asarray([[1] * 5 + [2] * 7])
  positions = jnp.asarray([list(range(5)) + list(range(7))])
  out = model(packed, positions, segments)
  np.testing.assert_allclose(out[:, :5], model(doc_a), atol=1e-5)
  np.testing.assert_allclose(out[:, 5:], model(doc_b), atol=1e-5)
  # Without segment ids doc B would see doc A: the test above is not vacuous.
  leaky = model(packed, positions)
  assert not np.allclose(leaky[:, 5:], model(doc_b), atol=1e-5)


def test_attention_mask_blocks_future_and_other_segments():
  seg_BT, pos_BT = jnp.asarray([[1, 1, 2, 2]]), jnp.arange(4)[None]
  mask = np.asarray(visible(pos_BT, pos_BT, causal=True, q_seg_BT=seg_BT, kv_seg_BS=seg_BT))[0]
  expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
  np.testing.assert_array_equal(mask, expected)


def test_scan_and_unrolled_layers_agree():
  tokens = _tokens()
  scanned = _model(scan_layers=True)(tokens)
  unrolled = _model(scan_layers=False)(tokens)
  np.testing.assert_allclose(scanned, unrolled, atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_saveable"])
def test_remat_changes_memory_not_gradients(remat):
  tokens = _tokens()

  def grads(model):
    graphdef, params = nnx.split(model, nnx.Param)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    return jax.grad(loss)(params)

  ref, got = grads(_model()), grads(_model(remat=remat))
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_gqa_equals_mha_with_repeated_kv_heads():
  """GQA with K kv heads equals MHA whose kv heads are each repeated G times."""
  gqa = _model()
  mha = _model(num_kv_heads=4)
  for name in ("wk_DKH", "wv_DKH"):
    w = getattr(gqa.blocks.attn, name)[...]
    getattr(mha.blocks.attn, name)[...] = jnp.repeat(w, 2, axis=2)
  for name in ("wq_DNH", "wo_NHD"):
    getattr(mha.blocks.attn, name)[...] = getattr(gqa.blocks.attn, name)[...]
  for path in (("blocks", "mlp", "gate_DF"), ("blocks", "mlp", "up_DF"), ("blocks", "mlp", "down_FD"),
               ("embed_VD",), ("unembed_DV",)):
    src, dst = gqa, mha
    for p in path[:-1]:
      src, dst = getattr(src, p), getattr(dst, p)
    getattr(dst, path[-1])[...] = getattr(src, path[-1])[...]
  tokens = _tokens()
  np.testing.assert_allclose(gqa(tokens), mha(tokens), atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = _model(dtype="bfloat16")
  assert model.embed_VD[...].dtype == jnp.float32
  logits = model(_tokens())
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _model()(_tokens()), atol=0.1)


def test_every_parameter_has_logical_axes_one_per_dimension():
  from parallel import LOGICAL_AXES
  params = nnx.state(_model(tie_embeddings=False), nnx.Param)
  for path, var in jax.tree.leaves_with_path(params, is_leaf=lambda v: isinstance(v, nnx.Variable)):
    names = var.get_metadata()["out_sharding"]
    assert len(names) == var[...].ndim, path
    assert set(names) <= set(LOGICAL_AXES), path


@pytest.mark.parametrize("kw, message", [
    (dict(d_model=30, num_heads=4), "num_heads=4 does not divide model.d_model=30"),
    (dict(num_heads=4, num_kv_heads=3), "num_heads=4 is not a multiple of model.num_kv_heads=3"),
    (dict(dtype="float8"), "model.dtype='float8'"),
    (dict(remat="sometimes"), "model.remat='sometimes'"),
    (dict(vocab_size=0), "model.vocab_size must be a positive integer"),
])
def test_bad_model_config_names_the_problem(kw, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    ModelConfig(**{**CFG, **kw})


def test_unknown_model_key_is_rejected():
  with pytest.raises(ConfigError, match="unknown model config key.*'d_modle'"):
    ModelConfig.from_mapping({**CFG, "d_modle": 3})
