"""KV cache: cached decoding gives the tokens and log-probabilities of recomputing everything."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer import Engine, SamplingParams, generate, kv_cache, packed_prefill
import models.attention as attention_lib
from models import ModelConfig, Transformer
from parallel import get_rules, logical_to_spec

LOGPROB_TOL = 1e-5  # float32; the cache only changes summation order
# init_std large enough that logits (and router scores) are well separated: no argmax near-ties.
CFG = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
           max_seq_len=64, init_std=0.2)
MOE = dict(num_experts=4, top_k=2, moe_impl="dropless")
PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40]]


class CharTokenizer:
  """Token i is the character chr(32 + i); no special tokens unless eos_id is set."""

  def __init__(self, eos_id=None):
    self.eos_id, self.bos_id = eos_id, None

  def encode(self, text, add_bos=None):
    return [ord(c) - 32 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i == self.eos_id))


def tiny_model(moe=False, **kw):
  return Transformer(ModelConfig(**{**CFG, **(MOE if moe else {}), **kw}), nnx.Rngs(0))


@pytest.fixture(scope="module", params=["dense", "moe", "sliding_window"])
def model(request):
  return tiny_model(moe=request.param == "moe",
                    sliding_window=5 if request.param == "sliding_window" else 0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_cached_decoding_matches_recomputing_every_step(model, sampled):
  engine = Engine(model, CharTokenizer(), max_batch=4)
  kw = dict(temperature=1.0, top_k=20, seed=3) if sampled else {}
  params = SamplingParams(max_tokens=12, logprobs=True, **kw)
  results = engine.generate(PROMPTS, params)
  for prompt, result in zip(PROMPTS, results):
    ids, logprobs = generate(model, prompt, 12, return_logprobs=True, **kw)
    assert result.token_ids == ids
    np.testing.assert_allclose(result.logprobs, logprobs, rtol=0, atol=LOGPROB_TOL)
    assert result.finish_reason == "length"


def test_prefill_logits_match_the_training_forward(model):
  tokens_BT = jnp.asarray([PROMPTS[1][:16], PROMPTS[0] + [0] * 13], jnp.int32)
  segment_ids_BT = jnp.asarray([[1] * 16, [1] * 3 + [0] * 13], jnp.int32)
  cache = kv_cache.init(model.cfg, 2, 64)
  logits_BV, cache = kv_cache.forward(model, tokens_BT, segment_ids_BT, cache)
  expected_BV = jnp.stack([model(tokens_BT[:1])[0, 15], model(tokens_BT[1:, :3])[0, 2]])
  np.testing.assert_allclose(logits_BV, expected_BV, rtol=0, atol=LOGPROB_TOL)
  np.testing.assert_array_equal(cache.lengths_B, [16, 3])
  np.testing.assert_array_equal(cache.segment_ids_BS[1, :4], [1, 1, 1, 0])
  # Token p sits in slot p (mod a sliding window's ring of 2W slots, which keeps the window).
  held = np.arange(16 - (model.cfg.sliding_window or 16), 16)
  assert cache.max_len == (2 * model.cfg.sliding_window or 64)
  np.testing.assert_array_equal(cache.positions_BS[0, held % cache.max_len], held)
  np.testing.assert_array_equal(cache.segment_ids_BS[0, held % cache.max_len], 1)


def test_empty_slots_are_never_attended(model):
  """Garbage in every slot with segment id 0 (padding, unwritten) changes nothing."""
  tokens_BT = jnp.asarray([PROMPTS[0] + [7] * 13], jnp.int32)
  segment_ids_BT = jnp.asarray([[1] * 3 + [0] * 13], jnp.int32)
  logits_BV, cache = kv_cache.forward(model, tokens_BT, segment_ids_BT,
                                      kv_cache.init(model.cfg, 1, 32))
  empty_11S11 = (cache.segment_ids_BS == 0)[None, :, :, None, None]
  noisy = cache._replace(k_LBSKH=jnp.where(empty_11S11, 1e4, cache.k_LBSKH),
                         v_LBSKH=jnp.where(empty_11S11, -1e4, cache.v_LBSKH))
  step = jnp.asarray([[11]], jnp.int32), jnp.ones((1, 1), jnp.int32)
  clean_BV, _ = kv_cache.forward(model, *step, cache)
  noisy_BV, _ = kv_cache.forward(model, *step, noisy)
  np.testing.assert_array_equal(clean_BV, noisy_BV)


def test_a_finished_row_leaves_its_cache_alone(model):
  tokens_BT = jnp.asarray([PROMPTS[0]], jnp.int32)
  _, cache = kv_cache.forward(model, tokens_BT, jnp.ones((1, 3), jnp.int32),
                              kv_cache.init(model.cfg, 1, 16))
  _, after = kv_cache.forward(model, jnp.asarray([[9]], jnp.int32), jnp.zeros((1, 1), jnp.int32),
                              cache)
  assert int(after.lengths_B[0]) == 3 and int(after.segment_ids_BS[0, 3]) == 0
  np.testing.assert_array_equal(after.k_LBSKH[:, :, :3], cache.k_LBSKH[:, :, :3])


def test_decode_reads_only_the_slots_in_use(model):
  """A batch's decode steps attend over the power of two above its longest row (16, then 32
  here: 14 + 12 tokens), with the same tokens and logprobs as recomputing every step."""
  prompts = [PROMPTS[1][:14], PROMPTS[0]]
  assert [kv_cache.width_for(n, 64) for n in (1, 15, 16, 17, 26, 100)] == [16, 16, 16, 32, 32, 64]
  assert kv_cache.reads_in_place(2, False) and not kv_cache.reads_in_place(1, False)
  results = Engine(model, CharTokenizer(), max_batch=2).generate(
      prompts, SamplingParams(max_tokens=12, logprobs=True))
  for prompt, result in zip(prompts, results):
    ids, logprobs = generate(model, prompt, 12, return_logprobs=True)
    assert result.token_ids == ids
    np.testing.assert_allclose(result.logprobs, logprobs, rtol=0, atol=LOGPROB_TOL)
  tokens_BT = jnp.asarray([prompts[0], prompts[1] + [0] * 11], jnp.int32)
  _, cache = kv_cache.forward(model, tokens_BT, (tokens_BT > 0).astype(jnp.int32),
                              kv_cache.init(model.cfg, 2, 64))
  step = jnp.asarray([[11], [12]], jnp.int32), jnp.ones((2, 1), jnp.int32)
  full_BV, full = kv_cache.forward(model, *step, cache)
  narrow_BV, narrow = kv_cache.forward(model, *step, cache, width=16)
  np.testing.assert_allclose(narrow_BV, full_BV, rtol=0, atol=LOGPROB_TOL)
  for a, b in zip(jax.tree.leaves(narrow), jax.tree.leaves(full)):
    np.testing.assert_array_equal(a, b)
  # ... and the narrow step does less work (XLA's cost model of the compiled step).
  graphdef, state = nnx.split(model)
  step_fn = jax.jit(lambda st, c, w: kv_cache.forward(nnx.merge(graphdef, st), *step, c, width=w),
                    static_argnums=2)
  flops = lambda w: _first(step_fn.lower(state, cache, w).compile().cost_analysis())["flops"]
  if kv_cache.ring_slots(model.cfg):  # a sliding window's ring holds 2W slots, fewer than 16
    assert cache.max_len == 2 * model.cfg.sliding_window < 16
  else:
    assert flops(16) < flops(None)


def _first(cost):
  return cost[0] if isinstance(cost, list) else cost


# Three prompts packed into 23 tokens (one attention tile), or three longer ones into 101
# (padded to 112: several tiles of packed_prefill.PACKED_TILE, those across two prompts skipped).
LONG_PROMPTS = [[(7 * i) % 50 + 1 for i in range(45)], [3, 1, 4, 1, 5, 9, 2, 6],
                [(5 * i) % 60 + 2 for i in range(48)]]


@pytest.fixture
def blockwise_calls(monkeypatch):
  """How many times attention() ran the blockwise kernel (traced calls) during the test."""
  calls = []
  inner = attention_lib._blockwise
  monkeypatch.setattr(attention_lib, "_blockwise", lambda *a: calls.append(1) or inner(*a))
  return calls


@pytest.mark.parametrize("prompts, t, packed_len", [(PROMPTS, 20, 24), (LONG_PROMPTS, 48, 112)],
                         ids=["one_tile", "many_tiles"])
def test_packed_prefill_fills_the_cache_as_padded_prefill_does(model, prompts, t, packed_len,
                                                               blockwise_calls):
  """Prompts packed into one row (fewer tokens than 4 right-padded rows), attended in tiles on
  CPU: the same logits at each last token, keys, values, slots and lengths as the
  right-padded prefill."""
  if packed_len > 100:
    assert -(-packed_len // packed_prefill.PACKED_TILE) >= 3
  if _check_packed_prefill(model, prompts, t, packed_len):
    assert blockwise_calls  # the padded prefill runs naive; only the packed one ran blockwise


def test_packed_prefill_with_a_position_bias_runs_naive(blockwise_calls, caplog):
  """A relative-position decoder's bias runs on the naive kernel: packed prefill asks for no
  tiles there (no fallback warning) and still matches the right-padded prefill."""
  model = tiny_model(position="relative", relative_buckets=8, relative_max_distance=16)
  assert _check_packed_prefill(model, LONG_PROMPTS, 48, 112)
  assert not blockwise_calls
  assert "falls back" not in caplog.text


def _check_packed_prefill(model, prompts, t, packed_len):
  b, slots = 4, 64
  tokens_BT, segment_ids_BT = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
  for i, prompt in enumerate(prompts):
    tokens_BT[i, :len(prompt)], segment_ids_BT[i, :len(prompt)] = prompt, 1
  padded_BV, padded = kv_cache.forward(model, jnp.asarray(tokens_BT), jnp.asarray(segment_ids_BT),
                                       kv_cache.init(model.cfg, b, slots))
  engine = Engine(model, CharTokenizer(), max_seq_len=slots, max_batch=b)
  requests = [engine._request(prompt, SamplingParams(max_tokens=4)) for prompt in prompts]
  packed_args = engine._packed(requests, b, b * t, kv_cache.slots_for(model.cfg, slots))
  if kv_cache.ring_slots(model.cfg):  # packed rows longer than a sliding window's ring are not
    assert packed_len > 2 * model.cfg.sliding_window and packed_args is None
    return False
  assert packed_args[0].shape == (1, packed_len)
  packed_BV, packed = packed_prefill.prefill_packed(model, *packed_args,
                                                    kv_cache.init(model.cfg, b, slots))
  n = len(prompts)
  np.testing.assert_allclose(packed_BV[:n], padded_BV[:n], rtol=0, atol=LOGPROB_TOL)
  np.testing.assert_array_equal(packed.lengths_B, padded.lengths_B)
  np.testing.assert_array_equal(packed.segment_ids_BS, padded.segment_ids_BS)
  real_11BS1 = (padded.segment_ids_BS > 0)[None, :, :, None, None]
  for ours, theirs in ((packed.k_LBSKH, padded.k_LBSKH), (packed.v_LBSKH, padded.v_LBSKH)):
    np.testing.assert_allclose(jnp.where(real_11BS1, ours, 0), jnp.where(real_11BS1, theirs, 0),
                               rtol=0, atol=LOGPROB_TOL)
  np.testing.assert_array_equal(jnp.where(padded.segment_ids_BS > 0, packed.positions_BS, -1),
                                jnp.where(padded.segment_ids_BS > 0, padded.positions_BS, -1))
  return True


def test_bucketing():
  sizes = [kv_cache.bucket(n, 1024) for n in (1, 16, 17, 21, 33, 64, 65, 100, 129, 1000)]
  assert sizes == [16, 16, 20, 24, 40, 64, 80, 112, 160, 1024]
  assert all(kv_cache.bucket(n, 4096) - n < 0.25 * n for n in range(17, 4097))
  assert len({kv_cache.bucket(n, 4096) for n in range(1, 4097)}) == 1 + 4 * 8
  assert kv_cache.bucket(33, 36) == 36 and kv_cache.bucket(5, 8) == 8
  with pytest.raises(ValueError, match="49 tokens do not fit in a cache of 48 slots"):
    kv_cache.bucket(49, 48)


def test_cache_shards_by_logical_names():
  spec = logical_to_spec(kv_cache.KV_AXES, get_rules("fsdp+tensor+sequence"))
  assert tuple(spec) == (None, ("data", "fsdp", "expert"), "sequence", "tensor", None)
  assert tuple(logical_to_spec(kv_cache.KV_AXES, get_rules("pipeline")))[0] == "pipeline"


def test_bfloat16_cache_keeps_the_compute_dtype():
  cache = kv_cache.init(ModelConfig(**CFG, dtype="bfloat16"), 2, 16)
  assert cache.k_LBSKH.dtype == jnp.bfloat16 and cache.k_LBSKH.shape == (2, 2, 16, 2, 8)
  assert jax.tree.map(lambda a: a.dtype, cache.lengths_B) == jnp.int32
