"""Paged KV cache and continuous batching: same outputs as the contiguous cache, block reuse,
prefix caching, chunked prefill, preemption by recompute, and bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer import Engine, SamplingParams, kv_cache, paged
from infer.block_manager import BlockManager, SeqBlocks
from infer.serving import PagedEngine
from models import ModelConfig, Transformer
from test_engine import PROMPTS
from test_kv_cache import CFG, LOGPROB_TOL, CharTokenizer, tiny_model

PARAMS = [SamplingParams(max_tokens=10, logprobs=True),
          SamplingParams(max_tokens=10, logprobs=True, temperature=1.0, top_k=20, seed=3,
                         repetition_penalty=1.3)]


@pytest.fixture(scope="module", params=["dense", "moe", "sliding_window"])
def model(request):
  return tiny_model(moe=request.param == "moe",
                    sliding_window=5 if request.param == "sliding_window" else 0)


def _same(a, b):
  for x, y in zip(a, b):
    assert x.token_ids == y.token_ids
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=LOGPROB_TOL)


def test_paged_attention_equals_the_contiguous_cache_through_shuffled_pages(model):
  """The same chunks through kv_cache.forward and paged.forward, pages in a scrambled order."""
  rng = np.random.default_rng(0)
  z, y = 4, 16  # 16 pages of 4 slots = the contiguous cache's 64
  table_BY = jnp.asarray(1 + rng.permutation(2 * y).reshape(2, y), jnp.int32)
  pool = paged.init_pool(model.cfg, 2 * y + 1, z)
  cache = kv_cache.init(model.cfg, 2, 64)
  chunks = [([PROMPTS[2][:16], PROMPTS[0] + [0] * 11], [[1] * 16, [1] * 5 + [0] * 11]),
            ([[3], [4]], [[1], [1]]), ([[7, 8, 9], [5, 0, 0]], [[1, 1, 1], [1, 0, 0]])]
  start_B = jnp.zeros(2, jnp.int32)
  for tokens, segs in chunks:
    tokens_BT, segment_ids_BT = jnp.asarray(tokens, jnp.int32), jnp.asarray(segs, jnp.int32)
    expected_BTV, cache = kv_cache.forward(model, tokens_BT, segment_ids_BT, cache,
                                           all_logits=True)
    got_BTV, pool = paged.forward(model, pool, tokens_BT, segment_ids_BT, start_B, table_BY,
                                  all_logits=True)
    real_BT1 = np.asarray(segment_ids_BT)[..., None] > 0
    np.testing.assert_allclose(np.where(real_BT1, got_BTV, 0), np.where(real_BT1, expected_BTV, 0),
                               rtol=0, atol=LOGPROB_TOL)
    start_B = cache.lengths_B
  # Every key the contiguous cache holds sits in the page its block table names.
  k_BSKH = paged.gather_pages(pool.k_LKWZH[1], table_BY)
  positions_BS, segment_ids_BS = np.asarray(cache.positions_BS), np.asarray(cache.segment_ids_BS)
  for b in range(2):  # (a sliding window's ring holds the last 2W positions, by position)
    held = np.flatnonzero(segment_ids_BS[b] > 0)
    # (equal up to summation order: the ring's prefill ran in pieces)
    np.testing.assert_allclose(k_BSKH[b, positions_BS[b, held]], cache.k_LBSKH[1, b, held],
                               rtol=0, atol=LOGPROB_TOL)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_continuous_batching_gives_the_contiguous_engines_outputs(model, params):
  contiguous = Engine(model, CharTokenizer(), max_seq_len=64, max_batch=8)
  # Fewer slots than prompts, small blocks and chunks: admission, chunked prefill, many pages.
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=3, block_size=4,
                       prefill_chunk=8, token_budget=12)
  _same(contiguous.generate(PROMPTS, params), engine.generate(PROMPTS, params))
  c = engine.counters()
  assert c["finished"] == len(PROMPTS) and c["running"] == c["waiting"] == 0
  assert c["blocks_used"] == 0 and c["blocks_peak"] > 0


def test_token_budget_and_batch_slots_are_respected():
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=3, block_size=4,
                       prefill_chunk=8, token_budget=10, prefix_caching=False)
  for prompt in PROMPTS:
    engine.add_request(prompt, SamplingParams(max_tokens=6))
  assert engine.counters()["waiting"] == len(PROMPTS)
  while engine.has_work:
    work = engine.scheduler.schedule()
    assert sum(n for _, n in work.chunks) <= 10 and len(engine.scheduler.running) <= 3
    assert all(n <= 8 for _, n in work.chunks)
    for seq, n in work.chunks:  # finish the step by hand: pretend-compute, then sample
      engine.scheduler.computed(seq, n)
      if not seq.remaining:
        seq.request.add(1, 0.0)
        if seq.request.done:
          engine.scheduler.finish(seq)
  assert engine.counters()["finished"] == len(PROMPTS)


def test_freed_blocks_are_reused():
  blocks = BlockManager(num_blocks=4, block_size=4, prefix_caching=False)
  a, b = SeqBlocks(), SeqBlocks()
  blocks.grow(a, 10)
  assert blocks.num_free == 1 and not blocks.can_grow(b, 8)
  blocks.free_seq(a)
  blocks.grow(b, 16)
  assert sorted(b.blocks) == [1, 2, 3, 4] and blocks.num_free == 0
  # Through the engine: a pool of 8 blocks serves 8 requests of 5-7 blocks each, one by one.
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=32, max_batch=2, block_size=4,
                       num_blocks=8, prefix_caching=False)
  results = engine.generate([p[:12] for p in PROMPTS], SamplingParams(max_tokens=12))
  assert all(r.finish_reason == "length" for r in results)
  assert engine.counters()["blocks_used"] == 0 and engine.blocks.counters.allocated > 8


def test_prefix_caching_skips_the_shared_prefix():
  model = Transformer(ModelConfig(**{**CFG, "max_seq_len": 128}), nnx.Rngs(0))
  prefix = [(5 * i + 1) % 64 for i in range(64)]
  first, second = prefix + [3, 4, 5], prefix + [9, 8]
  params = SamplingParams(max_tokens=6, logprobs=True)
  plain = PagedEngine(model, CharTokenizer(), max_seq_len=96, prefix_caching=False)
  expected = plain.generate([first, second], params)
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=96)
  engine.generate([first], params)
  before = engine.counters()
  result = engine.generate([second], params)
  after = engine.counters()
  assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 4  # 64 tokens / 16
  assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 64
  assert after["prefill_tokens"] - before["prefill_tokens"] == len(second) - 64
  _same(expected[1:], result)
  # A prompt that is all one cached prefix still computes its last token.
  again = engine.generate([prefix], params)
  assert engine.counters()["cached_prompt_tokens"] - after["cached_prompt_tokens"] == 48
  _same(plain.generate([prefix], params), again)


def test_preemption_by_recompute_keeps_the_outputs():
  model = tiny_model()
  contiguous = Engine(model, CharTokenizer(), max_seq_len=64, max_batch=8)
  # 12 blocks of 4 slots for 4 running requests growing to ~7 blocks each: preemption is forced.
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4, block_size=4,
                       num_blocks=12, prefill_chunk=8, token_budget=16)
  prompts = [p[:10] for p in PROMPTS]
  for params in PARAMS:
    params = SamplingParams(**{**params.__dict__, "max_tokens": 16})
    _same(contiguous.generate(prompts, params), engine.generate(prompts, params))
  assert engine.counters()["preemptions"] > 0


def test_streaming_serves_the_queue_too():
  model = tiny_model()
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4)
  other = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=20))
  tokens = list(engine.stream(PROMPTS[0], SamplingParams(max_tokens=5)))
  assert [t.token_id for t in tokens] == Engine(model, CharTokenizer(), max_seq_len=64).generate(
      [PROMPTS[0]], SamplingParams(max_tokens=5))[0].token_ids
  assert tokens[-1].finish_reason == "length"
  assert len(engine.sequences[other].request.token_ids) >= 5  # it ran alongside
  while engine.has_work:
    engine.step()
  assert len(engine.release(other).token_ids) == 20 and not engine.sequences


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty prompt"),
    (list(range(64)), SamplingParams(), "longer than the context: max_seq_len=64"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens=0 must be a positive integer"),
    ([1, 2], SamplingParams(max_tokens=-3), "max_tokens=-3 must be a positive integer"),
    ([1, 2], SamplingParams(max_tokens=63), "exceeds max_seq_len=64"),
])
def test_bad_requests_fail_cleanly_and_the_rest_are_served(prompt, params, message):
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=2)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    engine.add_request(prompt, params)
  batch = engine.generate([PROMPTS[0], prompt, PROMPTS[1]],
                          [SamplingParams(max_tokens=4), params, SamplingParams(max_tokens=4)])
  assert batch[1].finish_reason == "error" and message in batch[1].error
  assert [len(batch[0].token_ids), len(batch[2].token_ids)] == [4, 4]


def test_a_pool_too_small_for_a_request_is_refused():
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, block_size=4, num_blocks=3)
  with pytest.raises(ValueError, match="needs up to 5 KV blocks but the pool has 3"):
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=17))


def test_pool_layout_is_the_pallas_kernels():
  pool = paged.init_pool(tiny_model().cfg, 5, 16)
  assert pool.k_LKWZH.shape == (2, 2, 5, 16, 8)  # [L, K, pages, page slots, H]
  assert paged.page_bytes(tiny_model().cfg, 16) == 2 * 2 * 2 * 16 * 8 * 4
  assert jax.tree.map(lambda a: a.dtype, pool.v_LKWZH) == jnp.float32


def test_streams_get_their_tokens_whoever_runs_the_steps():
  model = tiny_model()
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4)
  expected = Engine(model, CharTokenizer(), max_seq_len=64).generate(
      PROMPTS[:3], SamplingParams(max_tokens=6))
  first, second = (engine.stream(p, SamplingParams(max_tokens=6)) for p in PROMPTS[:2])
  pairs = list(zip(first, second))  # the two streams take turns running steps
  assert [a.token_id for a, _ in pairs] == expected[0].token_ids
  assert [b.token_id for _, b in pairs] == expected[1].token_ids
  third = engine.stream(PROMPTS[2], SamplingParams(max_tokens=6))
  engine.generate([PROMPTS[3]], SamplingParams(max_tokens=8))  # runs the stream's steps too
  tokens = list(third)
  assert [t.token_id for t in tokens] == expected[2].token_ids
  assert tokens[-1].finish_reason == "length" and not engine.sequences


def test_a_badly_typed_request_in_a_batch_leaves_nothing_queued():
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=2)
  batch = engine.generate([PROMPTS[0], PROMPTS[1]],
                          [SamplingParams(max_tokens=3), SamplingParams(temperature=None)])
  assert batch[1].finish_reason == "error" and "temperature=None must be a number" in batch[1].error
  assert len(batch[0].token_ids) == 3
  assert not engine.has_work and not engine.sequences
