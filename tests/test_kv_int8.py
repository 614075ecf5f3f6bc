"""INT8 KV cache: int8 keys/values with a float32 scale per (token, kv head), in Engine and
PagedEngine; errors bounded by the quantization step, and about a quarter of the bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import Engine, SamplingParams, kv_cache, paged
from infer.serving import PagedEngine
from models import ModelConfig
from parallel import get_rules, logical_to_spec
from test_kv_cache import CFG, LOGPROB_TOL, PROMPTS, CharTokenizer, tiny_model

# float32 rounding of x / scale and of q · scale: a few ulps of values <= 127 steps, far below
# 1e-5 of a step; the half-step bound itself is exact arithmetic's.
ROUNDING_STEPS = 1e-5
SMOLLM2 = dict(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
               mlp_dim=1536, max_seq_len=2048)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def test_int8_greedy_generation_equals_the_float_cache(model):
  # Token for token on the dense tiny model (init_std 0.2): its top-2 logit margins along
  # these prompts exceed what int8 keys move them (~0.02 in logprob here). Models with
  # near-ties (the MoE and sliding-window fixtures of test_kv_cache) can flip a token;
  # the per-element bound the error must obey is test_attention_error_within_the_derived_bound.
  params = SamplingParams(max_tokens=24, logprobs=True)
  floats = Engine(model, CharTokenizer(), max_batch=4).generate(PROMPTS, params)
  int8s = Engine(model, CharTokenizer(), max_batch=4, kv_dtype="int8").generate(PROMPTS, params)
  paged_int8s = PagedEngine(model, CharTokenizer(), max_batch=4, block_size=4,
                            kv_dtype="int8").generate(PROMPTS, params)
  for f, q, p in zip(floats, int8s, paged_int8s):
    assert q.token_ids == f.token_ids
    # Paged and contiguous int8 caches hold the same int8 values and scales: they agree
    # to float32 summation order, like the float caches do.
    assert p.token_ids == q.token_ids
    np.testing.assert_allclose(p.logprobs, q.logprobs, rtol=0, atol=LOGPROB_TOL)


def _attend(kv_dtype, q_BTNH, k_BTKH, v_BTKH, s, cfg):
  """One layer's cached attention over a fresh cache of s slots: (out_BTNH, layer cache)."""
  b, t = q_BTNH.shape[:2]
  cache = kv_cache.init(cfg, b, s, kv_dtype)
  positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  segs_BT = jnp.ones((b, t), jnp.int32)
  zero_B = jnp.zeros(b, jnp.int32)
  slots = kv_cache._Slots(kv_cache.write_rows(cache.segment_ids_BS, segs_BT, zero_B),
                          kv_cache.write_rows(cache.positions_BS, positions_BT, zero_B), zero_B)
  layer = tuple(a[0] for a in cache.layers)
  return slots.attend(layer, q_BTNH, k_BTKH, v_BTKH, positions_BT, segs_BT, cfg)


def test_attention_error_within_the_derived_bound():
  """|out_int8 - out_float| per element <= the bound the quantization steps imply.

  A key off by at most ks_s/2 per element moves score s by at most
  d = H^-0.5 · sum_h |q_h| · max_s ks_s/2, so every softmax weight moves by a factor
  within e^(±2d), |p' - p| <= p·(e^(2d) - 1), and the output moves by at most
  (e^(2d) - 1)·max_s |v_sh| (weights) + max_s vs_s/2 (values off by half a step).
  """
  cfg = ModelConfig(**{**CFG, "num_heads": 4, "num_kv_heads": 2, "d_model": 64})
  b, t, s, n, k, h = 2, 12, 16, 4, 2, cfg.head_dim
  key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
  q_BTNH = jax.random.normal(key_q, (b, t, n, h))
  k_BTKH = jax.random.normal(key_k, (b, t, k, h)) * jnp.linspace(0.1, 3, h)  # uneven features
  v_BTKH = jax.random.normal(key_v, (b, t, k, h))
  out_f_BTNH, _ = _attend(None, q_BTNH, k_BTKH, v_BTKH, s, cfg)
  out_q_BTNH, (_, _, k_scale_BSK, v_scale_BSK) = _attend("int8", q_BTNH, k_BTKH, v_BTKH, s, cfg)
  g = n // k
  ks_B1N = jnp.repeat(k_scale_BSK.max(axis=1), g, axis=-1)[:, None]
  vs_B1N1 = jnp.repeat(v_scale_BSK.max(axis=1), g, axis=-1)[:, None, :, None]
  vmax_B1NH = jnp.repeat(jnp.abs(v_BTKH).max(axis=1), g, axis=1)[:, None]
  d_BTN = h ** -0.5 * jnp.abs(q_BTNH).sum(-1) * ks_B1N / 2
  bound_BTNH = jnp.expm1(2 * d_BTN)[..., None] * vmax_B1NH + vs_B1N1 / 2
  err_BTNH = jnp.abs(out_q_BTNH - out_f_BTNH)
  assert float(err_BTNH.max()) > 0  # the keys really were quantized
  assert bool(jnp.all(err_BTNH <= bound_BTNH + LOGPROB_TOL))


def test_quantize_dequantize_within_half_a_step():
  x_XH = jax.random.normal(jax.random.key(1), (64, 32)) * jnp.logspace(-3, 2, 64)[:, None]
  x_XH = x_XH.at[0].set(0.0)  # an all-zero vector: scale 0, no NaN
  q_XH, scale_X = kv_cache.quantize(x_XH)
  assert q_XH.dtype == jnp.int8 and scale_X.dtype == jnp.float32
  np.testing.assert_array_equal(jnp.abs(q_XH.astype(jnp.int32)).max(-1)[1:], 127)  # absmax: ±127
  err_XH = jnp.abs(kv_cache.dequantize(q_XH, scale_X, jnp.float32) - x_XH)
  assert bool(jnp.all(err_XH <= scale_X[:, None] * (0.5 + ROUNDING_STEPS)))
  assert float(scale_X[0]) == 0 and not bool(jnp.any(err_XH[0]))


def test_written_keys_within_half_a_step(model):
  """Layer 0's cached keys and values (its inputs do not depend on the cache) against the float
  cache's: each element within half its token's step."""
  tokens_BT = jnp.asarray([PROMPTS[1][:16], PROMPTS[0] + [0] * 13], jnp.int32)
  segment_ids_BT = jnp.asarray([[1] * 16, [1] * 3 + [0] * 13], jnp.int32)
  _, flt = kv_cache.forward(model, tokens_BT, segment_ids_BT, kv_cache.init(model.cfg, 2, 32))
  _, q8 = kv_cache.forward(model, tokens_BT, segment_ids_BT,
                           kv_cache.init(model.cfg, 2, 32, "int8"))
  assert q8.k_LBSKH.dtype == jnp.int8 and q8.k_scale_LBSK.shape == q8.k_LBSKH.shape[:-1]
  real_BS = np.asarray(q8.segment_ids_BS) > 0
  for name, scale in (("k_LBSKH", q8.k_scale_LBSK), ("v_LBSKH", q8.v_scale_LBSK)):
    got_BSKH = kv_cache.dequantize(getattr(q8, name)[0], scale[0], jnp.float32)
    err_BSKH = jnp.abs(got_BSKH - getattr(flt, name)[0])
    assert bool(jnp.all(err_BSKH[real_BS] <= scale[0][real_BS][..., None]
                        * (0.5 + ROUNDING_STEPS)))
  np.testing.assert_array_equal(q8.lengths_B, flt.lengths_B)


def _nbytes(tree):
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_ratio(dtype):
  cfg = ModelConfig(**SMOLLM2, dtype=dtype)
  h, size = cfg.head_dim, jnp.dtype(cfg.jnp_dtype).itemsize
  # Keys, values and scales (cache.layers) as init allocates them, shapes only.
  kv_bytes = {d: _nbytes(jax.eval_shape(lambda d=d: kv_cache.init(cfg, 1, 2048, d)).layers)
              for d in (None, "int8")}
  assert kv_bytes == {d: kv_cache.cache_bytes(cfg, 1, 2048, d) for d in (None, "int8")}
  # SmolLM2-135M at 2048 tokens, per sequence: 2·30·2048·3·64·4 B = 90 MiB in float32;
  # int8 + float32 scales: 2·30·2048·3·(64 + 4) B = 23.9 MiB.
  assert kv_bytes["int8"] == 2 * 30 * 2048 * 3 * (64 + 4) == 25_067_520
  if dtype == "float32":
    assert kv_bytes[None] == 2 * 30 * 2048 * 3 * 64 * 4 == 94_371_840
  assert kv_bytes["int8"] / kv_bytes[None] == pytest.approx((1 + 4 / h) / size, rel=1e-12)
  assert paged.page_bytes(cfg, 16, "int8") / paged.page_bytes(cfg, 16) == pytest.approx(
      (1 + 4 / h) / size, rel=1e-12)
  pool = jax.eval_shape(lambda: paged.init_pool(cfg, 3, 16, "int8"))
  assert _nbytes(pool) == 3 * paged.page_bytes(cfg, 16, "int8")


def test_scales_shard_like_the_cache():
  rules = get_rules("fsdp+tensor+sequence")
  assert (tuple(logical_to_spec(kv_cache.SCALE_AXES, rules))
          == tuple(logical_to_spec(kv_cache.KV_AXES, rules))[:-1])
  assert (tuple(logical_to_spec(paged.SCALE_AXES, rules))
          == tuple(logical_to_spec(paged.POOL_AXES, rules))[:-1])


@pytest.mark.parametrize("bad", ["fp8", "INT8", "float16", jnp.int8, 8])
def test_a_bad_kv_dtype_is_refused(model, bad):
  with pytest.raises(ValueError, match=re.escape(f"kv_dtype={bad!r} is not supported")):
    Engine(model, CharTokenizer(), kv_dtype=bad)
  with pytest.raises(ValueError, match="kv_dtype="):
    PagedEngine(model, CharTokenizer(), kv_dtype=bad)
  with pytest.raises(ValueError, match="kv_dtype="):
    kv_cache.init(model.cfg, 1, 16, bad)
