"""LoRA as a merged delta on the parameter tree (align/lora.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from align.lora import DEFAULT_TARGETS, init_lora, lora_param_count, lora_shardings, merge_lora
from models import ModelConfig, create_model

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def _setup(**overrides):
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, **overrides)
  graphdef, params = nnx.split(create_model(cfg, nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _inputs():
  tokens_BT = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
  positions_BT = jnp.broadcast_to(jnp.arange(8), (2, 8))
  return tokens_BT, positions_BT, jnp.ones((2, 8), jnp.int32)


def _logits(graphdef, params):
  return nnx.merge(graphdef, params)(*_inputs())


def _randomize(lora, key):
  """Nonzero a and b everywhere, so every delta is nonzero."""
  leaves, treedef = jax.tree.flatten(lora)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, x.shape, x.dtype)
                                      for k, x in zip(keys, leaves)])


def _leaf(params, path):
  node = params
  for k in path.split("/"):
    node = node[k]
  return node[...]


@pytest.mark.parametrize("jitted", [False, True])
def test_fresh_init_is_exactly_the_base(jitted):
  _, graphdef, params = _setup()
  if jitted:  # a State that went through jit (as a train step hands it back)
    params = jax.jit(lambda p: p)(params)
  lora = init_lora(params, RANK, jax.random.key(0))
  gqa = ("wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD", "gate_DF", "up_DF", "down_FD")
  assert set(gqa) < set(DEFAULT_TARGETS)  # the latent attention's are absent from this model
  assert set(lora) == {f"blocks/{m}/{n}" for n in gqa
                       for m in (("attn",) if n.startswith("w") else ("mlp",))}
  wq = _leaf(params, "blocks/attn/wq_DNH")
  l, d, n, h = wq.shape
  assert lora["blocks/attn/wq_DNH"]["a"].shape == (l, d, RANK)
  assert lora["blocks/attn/wq_DNH"]["b"].shape == (l, RANK, n * h)
  assert lora["blocks/mlp/down_FD"]["a"].shape == (l, 64, RANK)
  assert lora_param_count(lora) == sum(x.size for x in jax.tree.leaves(lora))

  merged = merge_lora(params, lora, ALPHA, RANK)
  assert type(merged) is type(params)
  assert jax.tree.structure(merged) == jax.tree.structure(params)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(merged)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
  assert merged["embed_VD"] is params["embed_VD"]  # untouched leaves pass through
  np.testing.assert_array_equal(np.asarray(_logits(graphdef, merged)),
                                np.asarray(_logits(graphdef, params)))


def test_merged_leaves_match_einsum_reference():
  _, graphdef, params = _setup()
  lora = _randomize(init_lora(params, RANK, jax.random.key(0)), jax.random.key(2))
  merged = jax.jit(lambda p, lo: merge_lora(p, lo, ALPHA, RANK))(params, lora)

  wq = _leaf(params, "blocks/attn/wq_DNH")
  l, d, n, h = wq.shape
  a, b = lora["blocks/attn/wq_DNH"]["a"], lora["blocks/attn/wq_DNH"]["b"]
  want_wq = wq + SCALE * jnp.einsum("LDR,LRNH->LDNH", a, b.reshape(l, RANK, n, h),
                                    precision="highest")
  np.testing.assert_allclose(_leaf(merged, "blocks/attn/wq_DNH"), want_wq, atol=1e-6, rtol=0)

  wo = _leaf(params, "blocks/attn/wo_NHD")  # input N·H, output D
  a, b = lora["blocks/attn/wo_NHD"]["a"], lora["blocks/attn/wo_NHD"]["b"]
  want_wo = wo + SCALE * jnp.einsum("LNHR,LRD->LNHD", a.reshape(l, n, h, RANK), b,
                                    precision="highest")
  np.testing.assert_allclose(_leaf(merged, "blocks/attn/wo_NHD"), want_wo, atol=1e-6, rtol=0)

  # The merged model is the base model with the hand-merged weights written in.
  # copy=True: nnx.merge reuses the State's Variables, so writing into it would edit `params`.
  ref = nnx.merge(graphdef, params, copy=True)
  ref.blocks.attn.wq_DNH[...] = want_wq
  ref.blocks.attn.wo_NHD[...] = want_wo
  for name in ("wk_DKH", "wv_DKH"):
    getattr(ref.blocks.attn, name)[...] = _leaf(merged, f"blocks/attn/{name}")
  for name in ("gate_DF", "up_DF", "down_FD"):
    getattr(ref.blocks.mlp, name)[...] = _leaf(merged, f"blocks/mlp/{name}")
  got = _logits(graphdef, merged)
  np.testing.assert_allclose(got, ref(*_inputs()), atol=1e-5, rtol=1e-5)
  assert not np.allclose(got, _logits(graphdef, params), atol=1e-3)


def test_merged_projection_equals_unmerged_form():
  _, _, params = _setup()
  lora = _randomize(init_lora(params, RANK, jax.random.key(0)), jax.random.key(3))
  merged = merge_lora(params, lora, ALPHA, RANK)
  x_BTD = jax.random.normal(jax.random.key(4), (2, 8, 32))
  hp = "highest"

  w_DNH = _leaf(params, "blocks/attn/wq_DNH")[0]  # layer 0
  _, n, h = w_DNH.shape
  a_DR, b_RM = lora["blocks/attn/wq_DNH"]["a"][0], lora["blocks/attn/wq_DNH"]["b"][0]
  unmerged_BTNH = (jnp.einsum("BTD,DNH->BTNH", x_BTD, w_DNH, precision=hp)
                   + SCALE * ((x_BTD @ a_DR) @ b_RM).reshape(2, 8, n, h))
  got_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, _leaf(merged, "blocks/attn/wq_DNH")[0],
                        precision=hp)
  np.testing.assert_allclose(got_BTNH, unmerged_BTNH, atol=1e-5, rtol=1e-5)

  w_FD = _leaf(params, "blocks/mlp/down_FD")[1]  # layer 1, input F
  x_BTF = jax.random.normal(jax.random.key(5), (2, 8, w_FD.shape[0]))
  a_FR, b_RD = lora["blocks/mlp/down_FD"]["a"][1], lora["blocks/mlp/down_FD"]["b"][1]
  unmerged_BTD = x_BTF @ w_FD + SCALE * ((x_BTF @ a_FR) @ b_RD)
  got_BTD = jnp.matmul(x_BTF, _leaf(merged, "blocks/mlp/down_FD")[1], precision=hp)
  np.testing.assert_allclose(got_BTD, unmerged_BTD, atol=1e-5, rtol=1e-5)


def test_grad_flows_to_adapters_only():
  _, graphdef, params = _setup()
  lora = init_lora(params, RANK, jax.random.key(0))
  tokens_BT, positions_BT, segment_ids_BT = _inputs()

  # `params` is closed over, not an argument of grad: the base stays frozen and
  # no gradient (or optimizer state) is ever made for it.
  def loss(lora):
    model = nnx.merge(graphdef, merge_lora(params, lora, ALPHA, RANK))
    logits_BTV = model(tokens_BT, positions_BT, segment_ids_BT)
    logp_BTV = jax.nn.log_softmax(logits_BTV)
    return -jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1).mean()

  grads = jax.jit(jax.grad(loss))(lora)
  assert jax.tree.structure(grads) == jax.tree.structure(lora)
  for path, g in grads.items():
    # d/da of a @ b is (dW) b^T = 0 while b = 0: only b learns on the first step.
    assert float(jnp.abs(g["a"]).max()) == 0.0, path
    assert float(jnp.abs(g["b"]).max()) > 0.0, path

  # Once b is nonzero, a gets gradient too.
  stepped = jax.tree.map(lambda x, g: x - 0.1 * g, lora, grads)
  grads = jax.grad(loss)(stepped)
  assert all(float(jnp.abs(g["a"]).max()) > 0.0 for g in grads.values())


@pytest.mark.parametrize("overrides", [{"scan_layers": False}, {"param_dtype": "bfloat16"}])
def test_unscanned_and_bfloat16(overrides):
  _, graphdef, params = _setup(**overrides)
  lora = init_lora(params, RANK, jax.random.key(0))
  fresh = merge_lora(params, lora, ALPHA, RANK)
  np.testing.assert_array_equal(np.asarray(_logits(graphdef, fresh)),
                                np.asarray(_logits(graphdef, params)))

  lora = _randomize(lora, jax.random.key(6))
  merged = merge_lora(params, lora, ALPHA, RANK)
  w = _leaf(params, "blocks/mlp/up_DF")
  a, b = lora["blocks/mlp/up_DF"]["a"], lora["blocks/mlp/up_DF"]["b"]
  want = (w.astype(jnp.float32) + SCALE * jnp.matmul(a, b, precision="highest")).astype(w.dtype)
  got = _leaf(merged, "blocks/mlp/up_DF")
  assert got.dtype == w.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=1e-6, rtol=0)
  assert jnp.isfinite(_logits(graphdef, merged)).all()


def test_bad_inputs():
  _, _, params = _setup()
  with pytest.raises(ValueError, match="rank must be a positive int"):
    init_lora(params, 0, jax.random.key(0))
  with pytest.raises(ValueError, match=r"LoRA targets \('wq_proj', 'q_proj'\)"):
    init_lora(params, RANK, jax.random.key(0), targets=("wq_proj", "q_proj"))
  lora = init_lora(params, RANK, jax.random.key(0), targets=("wq_DNH",))
  assert list(lora) == ["blocks/attn/wq_DNH"]
  with pytest.raises(ValueError, match="rank must be a positive int"):
    merge_lora(params, lora, ALPHA, 0)
  with pytest.raises(ValueError, match="has rank 4, merge_lora got 2"):
    merge_lora(params, lora, ALPHA, 2)
  with pytest.raises(ValueError, match="match no parameter"):
    merge_lora(params, {**lora, "blocks/attn/nope_DNH": lora["blocks/attn/wq_DNH"]}, ALPHA, RANK)
  with pytest.raises(ValueError, match="needs a"):
    merge_lora(params, init_lora(params, RANK, jax.random.key(0), targets=("wq_DNH",)) | {
        "blocks/attn/wq_DNH": {"a": jnp.zeros((2, 31, RANK)), "b": jnp.zeros((2, RANK, 32))}},
        ALPHA, RANK)


def test_shardings_replicated():
  _, _, params = _setup()
  lora = init_lora(params, RANK, jax.random.key(0))
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  shardings = lora_shardings(lora, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(lora)
  assert all(s.is_fully_replicated for s in jax.tree.leaves(shardings))
  placed = jax.device_put(lora, shardings)
  assert lora_param_count(placed) == lora_param_count(lora)


def test_latent_attention_projections_get_adapters_of_their_own_shapes():
  """DeepSeek's projections (models/mla.py) read their contraction letters: q_b_proj reads the
  query latent Q and writes every head's H + R features."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                    head_dim=8, mlp_dim=48, kv_lora_rank=16, q_lora_rank=12, rope_head_dim=4,
                    v_head_dim=6)
  params = nnx.state(create_model(cfg, nnx.Rngs(0)), nnx.Param)
  lora = init_lora(params, RANK, jax.random.key(0))
  shapes = {p: (v["a"].shape, v["b"].shape) for p, v in lora.items()}
  assert shapes["blocks/attn/wq_b_QNX"] == ((2, 12, RANK), (2, RANK, 4 * 12))
  assert shapes["blocks/attn/wk_b_CNH"] == ((2, 16, RANK), (2, RANK, 4 * 8))
  assert shapes["blocks/attn/wo_NUD"] == ((2, 4 * 6, RANK), (2, RANK, 32))
  assert {p.rsplit("/", 1)[1] for p in lora} == {
      "wq_a_DQ", "wq_b_QNX", "wkv_a_DC", "wkr_DR", "wk_b_CNH", "wv_b_CNU", "wo_NUD", "gate_DF",
      "up_DF", "down_FD"}
