"""What a server needs from the PagedEngine: aborting a request frees its blocks at once,
top-logprobs are the model's, a broken checkpoint fails loudly, and a reset engine serves on."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer.serving
from infer import SamplingParams, paged
from infer.serving import PagedEngine
from test_engine import PROMPTS
from test_kv_cache import CharTokenizer, tiny_model


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _engine(model, **kw):
  return PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=2, block_size=4, **kw)


def test_abort_frees_the_blocks_of_running_and_waiting_requests(model):
  engine = _engine(model)
  params = SamplingParams(max_tokens=20, ignore_eos=True)
  running = [engine.add_request(p, params) for p in PROMPTS[:2]]
  waiting = engine.add_request(PROMPTS[2], params)  # max_batch=2: it waits
  for _ in range(3):
    engine.step()
  assert engine.counters()["blocks_used"] > 0 and engine.counters()["waiting"] == 1
  for rid in running + [waiting]:
    engine.abort(rid)
  c = engine.counters()
  assert (c["blocks_used"], c["running"], c["waiting"], c["aborted"]) == (0, 0, 0, 3)
  assert not engine.has_work and not engine.sequences
  # the engine serves the next request as if nothing happened
  alone = _engine(model).generate(PROMPTS[0], params)[0]
  assert engine.generate(PROMPTS[0], params)[0].token_ids == alone.token_ids


def test_top_logprobs_are_the_most_likely_tokens_of_the_model(model):
  engine = _engine(model)
  out = []
  rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, logprobs=True,
                                                       top_logprobs=3))
  while engine.has_work:
    out += [t for r, t in engine.step() if r == rid]
  assert len(out) == 4
  for token in out:
    ids, values = zip(*token.top_logprobs)
    assert len(ids) == 3 and list(values) == sorted(values, reverse=True)
    assert ids[0] == token.token_id  # greedy picks the most likely token
    assert values[0] == pytest.approx(token.logprob, abs=1e-5)
  plain = _engine(model).generate(PROMPTS[1], SamplingParams(max_tokens=4))[0]
  assert plain.token_ids == [t.token_id for t in out]  # asking for alternatives changes nothing


def test_a_model_with_non_finite_weights_fails_its_requests_with_a_reason(model):
  broken = nnx.clone(model)
  broken.final_norm.scale[...] = jnp.full_like(broken.final_norm.scale[...], jnp.nan)
  engine = _engine(broken)
  result = engine.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=5))
  for r in result:
    assert r.finish_reason == "error" and "non-finite" in r.error and r.token_ids == []
  assert engine.counters()["blocks_used"] == 0


def test_reset_drops_everything_and_serves_again(model):
  engine = _engine(model)
  engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
  engine.step()
  engine.reset()
  assert not engine.has_work and engine.counters()["blocks_used"] == 0
  r = engine.generate(PROMPTS[1], SamplingParams(max_tokens=6))[0]
  expected = _engine(model).generate(PROMPTS[1], SamplingParams(max_tokens=6))[0]
  assert r.token_ids == expected.token_ids


def test_precompile_covers_every_step_the_scheduler_runs(model, monkeypatch):
  engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4, block_size=4,
                       prefill_chunk=32)
  assert engine.precompile() == len(engine.step_shapes())
  monkeypatch.setattr(infer.serving, "_step", None)  # nothing may compile from here on
  params = SamplingParams(max_tokens=12, ignore_eos=True)
  prompts = [p * 2 for p in PROMPTS if len(p) <= 24] + PROMPTS  # chunks of many lengths
  results = engine.generate(prompts, params)
  monkeypatch.undo()
  fresh = _engine(model, prefill_chunk=32)
  assert all(r.finish_reason == "length" for r in results)
  assert [r.token_ids for r in results] == [r.token_ids for r in fresh.generate(prompts, params)]


def test_reading_the_pool_in_place_equals_writing_it_per_layer(model):
  """Both ways of writing the pool give the same logits and the same pages, chunk after
  chunk (prefill across pages, then decode), with shuffled block tables."""
  rng = np.random.default_rng(0)
  table_BY = jnp.asarray(1 + rng.permutation(24).reshape(2, 12), jnp.int32)
  pools = {way: paged.init_pool(model.cfg, 25, 4) for way in (True, False)}
  start_B = jnp.zeros(2, jnp.int32)
  for tokens, real in (([PROMPTS[2][:11], PROMPTS[5][:11]], [11, 6]), ([[3], [4]], [1, 1]),
                       ([[7, 8, 9], [5, 6, 0]], [3, 2])):
    tokens_BT = jnp.asarray(tokens, jnp.int32)
    segment_ids_BT = (jnp.arange(tokens_BT.shape[1])[None] < jnp.asarray(real)[:, None])
    out = {}
    for way in (True, False):
      out[way], pools[way] = paged.forward(model, pools[way], tokens_BT,
                                           segment_ids_BT.astype(jnp.int32), start_B, table_BY,
                                           all_logits=True, in_place=way)
    real_BT1 = np.asarray(segment_ids_BT)[..., None]
    np.testing.assert_allclose(np.where(real_BT1, out[True], 0), np.where(real_BT1, out[False], 0),
                               rtol=0, atol=1e-5)
    start_B = start_B + jnp.asarray(real)
  used = np.asarray(table_BY).ravel()  # the null page takes padding writes either way
  np.testing.assert_array_equal(np.asarray(pools[True].k_LKWZH)[:, :, used],
                                np.asarray(pools[False].k_LKWZH)[:, :, used])
  np.testing.assert_array_equal(np.asarray(pools[True].v_LKWZH)[:, :, used],
                                np.asarray(pools[False].v_LKWZH)[:, :, used])
