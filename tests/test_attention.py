"""Attention kernels: blockwise (flash) equals the naive reference, forward and backward,
masked rows give zeros, dispatch falls back cleanly, and blockwise memory is O(n).

Tolerance: max absolute difference <= 1e-5 in float32 (inputs and cotangents ~ N(0, 1)).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ConfigError, ModelConfig, Transformer
from models import attention as attn_lib
from models.attention import attention

TOL = 1e-5


def _qkv(b, t, s, n, k, h=16, seed=0):
  r = np.random.default_rng(seed)
  return tuple(jnp.asarray(r.normal(size=shape), jnp.float32)
               for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h)))


def _packed_segments(b, t, seed=0):
  """Rows of several documents followed by padding (segment 0), different per row."""
  r = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(r.choice(np.arange(1, t - 3), size=3, replace=False))
    for i, (lo, hi) in enumerate(zip([0, *cuts[:2]], cuts)):
      seg[row, lo:hi] = i + 1
  return jnp.asarray(seg)


def _check_against_naive(q, k, v, block_q, block_kv, **kw):
  """Max abs differences (out, dq, dk, dv) of blockwise vs naive under one random cotangent."""
  cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

  @jax.jit  # one compile per case: much faster than running the scans op by op
  def both(q, k, v, cot):
    def run(impl):
      f = lambda q, k, v: attention(q, k, v, impl=impl, block_q=block_q, block_kv=block_kv, **kw)
      out, vjp = jax.vjp(f, q, k, v)
      return (out, *vjp(cot))
    return run("naive"), run("blockwise")

  ref, got = both(q, k, v, cot)
  diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, got)]
  print("max abs diff out, dq, dk, dv:", " ".join(f"{d:.1e}" for d in diffs))
  assert all(np.isfinite(diffs)), diffs
  assert max(diffs) <= TOL, f"max abs diff (out, dq, dk, dv) = {diffs}"
  return diffs


# (b, t, s, n, k): GQA ratios 1, 2, 4; odd lengths; block sizes smaller than, dividing,
# and larger than the sequence. Each case is a compile (~2 s), so the grid is sparse.
@pytest.mark.parametrize("shape,bq,bkv,causal", [
    pytest.param((2, 37, 37, 4, 4), 8, 16, True, id="mha-T37-b8x16-causal"),
    pytest.param((2, 37, 37, 4, 4), 8, 16, False, id="mha-T37-b8x16-full"),
    pytest.param((2, 37, 37, 4, 2), 16, 8, True, id="gqa2-T37-b16x8-causal"),
    pytest.param((1, 64, 64, 8, 2), 16, 16, False, id="gqa4-T64-b16-full"),
    pytest.param((2, 37, 37, 8, 2), 512, 512, True, id="gqa4-T37-one-block-causal"),
])
def test_blockwise_matches_naive_self_attention(shape, bq, bkv, causal):
  b, t, s, n, k = shape
  _check_against_naive(*_qkv(b, t, s, n, k), bq, bkv, causal=causal)


@pytest.mark.parametrize("shape,bq,bkv,window", [
    pytest.param((2, 37, 37, 4, 4), 8, 16, 0, id="mha-T37-b8x16"),
    pytest.param((2, 37, 37, 4, 2), 16, 8, 1, id="gqa2-T37-b16x8-window1"),
    pytest.param((1, 64, 64, 8, 2), 16, 16, 6, id="gqa4-T64-b16-window6"),
])
def test_blockwise_matches_naive_packed_rows(shape, bq, bkv, window):
  """Several documents per row plus trailing padding, optionally a sliding window."""
  b, t, s, n, k = shape
  seg = _packed_segments(b, t)
  _check_against_naive(*_qkv(b, t, s, n, k), bq, bkv, q_segment_ids_BT=seg,
                       kv_segment_ids_BS=seg, sliding_window=window or None)


def _cache(b, s, written):
  """A KV cache of S slots with `written[row]` filled: positions 0.., segment 1, rest empty."""
  kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  kv_seg = (kv_pos < jnp.asarray(written)[:, None]).astype(jnp.int32)
  return kv_pos, kv_seg


@pytest.mark.parametrize("window,bkv", [(0, 16), (9, 53)])
def test_blockwise_matches_naive_decode(window, bkv):
  """T=1 query per row at its own position against a partly filled cache of 53 slots."""
  b, s, n, k = 3, 53, 4, 2
  kv_pos, kv_seg = _cache(b, s, [40, 21, 53])
  q_pos = jnp.asarray([[39], [20], [52]])
  _check_against_naive(*_qkv(b, 1, s, n, k), 1, bkv, q_positions_BT=q_pos,
                       kv_positions_BS=kv_pos, q_segment_ids_BT=jnp.ones((b, 1), jnp.int32),
                       kv_segment_ids_BS=kv_seg, sliding_window=window or None)


def test_blockwise_matches_naive_prefill_chunk():
  """A chunk of 7 queries at positions 30..36 against a cache holding 0..36: causal by position."""
  b, s, n, k = 2, 53, 4, 2
  kv_pos, kv_seg = _cache(b, s, [37, 37])
  q_pos = jnp.broadcast_to(jnp.arange(30, 37), (b, 7))
  _check_against_naive(*_qkv(b, 7, s, n, k), 4, 8, q_positions_BT=q_pos, kv_positions_BS=kv_pos,
                       kv_segment_ids_BS=kv_seg, sliding_window=12)


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_rows_without_visible_keys_give_zero(impl):
  """Padding queries and a query whose segment has no keys: zero output, zero finite grads."""
  b, t, n, k = 1, 12, 4, 2
  q, kk, v = _qkv(b, t, t, n, k)
  q_seg = jnp.asarray([[1, 1, 1, 1, 3, 3, 2, 2, 2, 0, 0, 0]])
  kv_seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]])
  f = lambda q, kk, v: attention(q, kk, v, q_segment_ids_BT=q_seg, kv_segment_ids_BS=kv_seg,
                                 impl=impl, block_q=4, block_kv=4)
  out = f(q, kk, v)
  blind = np.asarray([0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], bool)
  np.testing.assert_array_equal(np.asarray(out)[0, blind], 0.0)
  assert np.all(np.abs(np.asarray(out)[0, ~blind]) > 0)
  dq, dk, dv = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(q, kk, v)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))
  np.testing.assert_array_equal(np.asarray(dq)[0, blind], 0.0)


def test_auto_is_naive_on_small_cpu_problems_and_fast_paths_fall_back(caplog):
  q, k, v = _qkv(2, 37, 37, 4, 2)
  seg = _packed_segments(2, 37)
  kw = dict(q_segment_ids_BT=seg, kv_segment_ids_BS=seg, block_q=16, block_kv=16)
  naive, blockwise = (attention(q, k, v, impl=i, **kw) for i in ("naive", "blockwise"))
  np.testing.assert_array_equal(attention(q, k, v, impl="auto", **kw), naive)
  with caplog.at_level(logging.WARNING, logger="models.attention"):
    for impl in ("cudnn", "pallas"):
      np.testing.assert_array_equal(attention(q, k, v, impl=impl, **kw), blockwise)
  assert "not on a GPU" in caplog.text and "not on a TPU" in caplog.text


@pytest.mark.parametrize("kernel", ["cudnn-call-via-xla", "pallas-interpreted"])
def test_fast_path_wiring_matches_naive(kernel):
  """The GPU/TPU paths' argument mapping (scale, layout, GQA, windows, segment ids, padding),
  run on CPU: the cuDNN call with implementation="xla", splash attention interpreted."""
  b, t, n, k, h = 1, 256, 4, 2, 128
  q, kk, v = _qkv(b, t, t, n, k, h)
  seg = jnp.asarray([[1] * 100 + [2] * 120 + [0] * 36])
  cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  window = 17  # a window, two documents and padding: every masking feature at once
  spec = attn_lib._Spec(True, window, True, h ** -0.5, 128, 128)
  if kernel == "pallas-interpreted":
    fast = lambda q, kk, v: attn_lib._pallas(q, kk, v, seg, spec, interpret=True)
  else:
    fast = lambda q, kk, v: attn_lib._cudnn(q, kk, v, seg, spec, implementation="xla")
  ref = lambda q, kk, v: attention(q, kk, v, q_segment_ids_BT=seg, kv_segment_ids_BS=seg,
                                   sliding_window=window, impl="naive")
  (a, a_vjp), (b_, b_vjp) = jax.vjp(fast, q, kk, v), jax.vjp(ref, q, kk, v)
  for x, y in zip((a, *a_vjp(cot)), (b_, *b_vjp(cot))):
    np.testing.assert_allclose(x, y, atol=TOL, rtol=0)

def test_bad_arguments_are_rejected():
  q, k, v = _qkv(1, 4, 4, 4, 2)
  with pytest.raises(ValueError, match="impl"):
    attention(q, k, v, impl="flash")
  with pytest.raises(ValueError, match="sliding_window"):
    attention(q, k, v, causal=False, sliding_window=3)
  with pytest.raises(ValueError, match="positions"):
    attention(q, k, v, q_positions_BT=jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ConfigError, match="attention_impl"):
    ModelConfig(attention_impl="flash")
  with pytest.raises(ConfigError, match="sliding_window"):
    ModelConfig(sliding_window=-1)


def test_model_blockwise_equals_naive_and_window_changes_logits():
  cfg = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 40)), jnp.int32)
  seg = _packed_segments(2, 40)
  model = lambda **kw: Transformer(ModelConfig(**cfg, **kw), nnx.Rngs(0))
  run = lambda **kw: nnx.jit(lambda m: m(tokens, None, seg))(model(**kw))
  naive = run(attention_impl="naive")
  np.testing.assert_allclose(run(attention_impl="blockwise"), naive, atol=TOL, rtol=0)
  assert not np.allclose(run(sliding_window=4), naive, atol=1e-3)

  def grads(**kw):  # through scanned, rematerialised layers
    graphdef, params = nnx.split(model(remat="full", **kw), nnx.Param)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens, None, seg) ** 2)
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

  for a, b in zip(grads(attention_impl="naive"), grads(attention_impl="blockwise")):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def _temp_bytes(impl, t, block):
  """Compiled temporary memory of value_and_grad(sum(attention(q, k, v)**2)); compile only."""
  shapes = [jax.ShapeDtypeStruct((1, t, 4, 64), jnp.float32)] + [
      jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)] * 2
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, impl=impl, block_q=block, block_kv=block) ** 2)
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_is_linear():
  """Temp memory of blockwise forward+backward doubles with the sequence; naive's quadruples."""
  # Measured (jax 0.10.2, CPU): blockwise 9.9 / 18.0 / 34.1 MiB at 2k / 4k / 8k,
  # naive 260 / 1032 / 4112 MiB (only 8k is compiled here).
  lengths = (2048, 4096, 8192)
  blockwise = [_temp_bytes("blockwise", t, 128) for t in lengths]
  naive = _temp_bytes("naive", lengths[-1], 128)
  print("blockwise MiB at", lengths, [round(b / 2**20, 1) for b in blockwise],
        f"; naive at {lengths[-1]}: {naive / 2**20:.1f} MiB")
  for a, b in zip(blockwise, blockwise[1:]):
    assert 1.6 <= b / a <= 2.4, blockwise
  assert blockwise[-1] <= naive / 8, (blockwise, naive)
