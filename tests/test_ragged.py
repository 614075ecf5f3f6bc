"""Ragged paged attention (infer/ragged.py): the block tables' results from a flat page list."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer.serving
from infer import SamplingParams, paged, ragged
from infer.serving import PagedEngine
from models import layer_weights
from test_engine import PROMPTS
from test_kv_cache import LOGPROB_TOL, CharTokenizer, tiny_model


# a prefill across pages with a padded row, a decode token, a ragged chunk
CHUNKS = [([PROMPTS[2][:16], PROMPTS[0] + [0] * 11], [[1] * 16, [1] * 5 + [0] * 11]),
          ([[3], [4]], [[1], [1]]), ([[7, 8, 9], [5, 0, 0]], [[1, 1, 1], [1, 0, 0]])]


@pytest.fixture(scope="module", params=["dense", "moe", "sliding_window"])
def model(request):
  return tiny_model(moe=request.param == "moe",
                    sliding_window=5 if request.param == "sliding_window" else 0)


def test_ragged_pages_give_the_block_tables_results(model):
  """The same chunks (a prefill across pages with a padded row, a decode token, a ragged
  chunk) through the tables and through a flat page list: same logits, same pages."""
  rng = np.random.default_rng(0)
  z, y = 4, 16
  tables = 1 + rng.permutation(2 * y).reshape(2, y)
  pools = {way: paged.init_pool(model.cfg, 2 * y + 1, z) for way in ("tables", "ragged")}
  start_B = np.zeros(2, np.int32)
  for tokens, segs in CHUNKS:
    tokens_BT, segment_ids_BT = jnp.asarray(tokens, jnp.int32), jnp.asarray(segs, jnp.int32)
    ends = [int(e) for e in start_B + np.sum(segs, axis=1)]
    # 12 entries listed for at most 3 in use (7 pages): the padding entries must change nothing
    flat = ragged.build([list(t) for t in tables], ends, 2, z, 12)
    assert ragged.count(ends, z) == int(np.sum(flat.block_P >= 0))
    want_BTV, pools["tables"] = paged.forward(model, pools["tables"], tokens_BT, segment_ids_BT,
                                              jnp.asarray(start_B), jnp.asarray(tables),
                                              all_logits=True)
    got_BTV, pools["ragged"] = paged.forward(model, pools["ragged"], tokens_BT, segment_ids_BT,
                                             jnp.asarray(start_B), None, all_logits=True,
                                             ragged=jax.tree.map(jnp.asarray, flat))
    real_BT1 = np.asarray(segment_ids_BT)[..., None] > 0
    np.testing.assert_allclose(np.where(real_BT1, got_BTV, 0), np.where(real_BT1, want_BTV, 0),
                               rtol=0, atol=LOGPROB_TOL)
    start_B = np.asarray(ends, np.int32)
  for name in ("k_LKWZH", "v_LKWZH"):  # page 0 takes padding's writes: not compared
    np.testing.assert_allclose(getattr(pools["ragged"], name)[:, :, 1:],
                               getattr(pools["tables"], name)[:, :, 1:], rtol=0, atol=1e-5)


def test_unrolled_layers_write_their_pages_in_place_with_the_scans_results(model):
  """paged.forward over per-layer weights (models/layer_weights.py: each layer writes its
  chunk into the pool itself), through tables and through a flat list: the layer scan's
  logits and pages."""
  graphdef, state = nnx.split(model)
  unrolled = layer_weights.merge(graphdef, layer_weights.unstack(state))
  assert layer_weights.is_unrolled(unrolled)
  z, y = 4, 16
  tables = 1 + np.random.default_rng(1).permutation(2 * y).reshape(2, y)
  for way in ("tables", "ragged"):
    pools = [paged.init_pool(model.cfg, 2 * y + 1, z) for _ in range(2)]
    start_B = np.zeros(2, np.int32)
    for tokens, segs in CHUNKS:
      tokens_BT, segment_ids_BT = jnp.asarray(tokens, jnp.int32), jnp.asarray(segs, jnp.int32)
      ends = [int(e) for e in start_B + np.sum(segs, axis=1)]
      kw = (dict(ragged=jax.tree.map(jnp.asarray, ragged.build([list(t) for t in tables], ends,
                                                               2, z, 12)))
            if way == "ragged" else {})
      table_BY = None if kw else jnp.asarray(tables)
      logits = []
      for i, m in enumerate((model, unrolled)):
        out_BTV, pools[i] = paged.forward(m, pools[i], tokens_BT, segment_ids_BT,
                                          jnp.asarray(start_B), table_BY, all_logits=True, **kw)
        logits.append(np.where(np.asarray(segment_ids_BT)[..., None] > 0, out_BTV, 0))
      np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=LOGPROB_TOL)
      start_B = np.asarray(ends, np.int32)
    for name in ("k_LKWZH", "v_LKWZH"):  # page 0 takes padding's writes: not compared
      np.testing.assert_allclose(getattr(pools[1], name)[:, :, 1:],
                                 getattr(pools[0], name)[:, :, 1:], rtol=0, atol=1e-5)


def test_paged_engine_decodes_the_same_with_and_without_ragged_pages(model):
  """Ragged or table decode steps, over per-layer weights or the layer scan: one output."""
  params = [SamplingParams(max_tokens=10, logprobs=True),
            SamplingParams(max_tokens=10, logprobs=True, temperature=1.0, top_k=20, seed=3)]
  results = {}
  for way, unroll in ((True, True), (False, True), (True, False)):
    engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4, block_size=4,
                         prefill_chunk=8, ragged_decode=way, unroll_layers=unroll)
    results[way, unroll] = engine.generate(PROMPTS, params * (len(PROMPTS) // 2))
    assert (engine.counters()["ragged_decode_steps"] > 0) == way
    assert isinstance(engine.weights(), layer_weights.LayerWeights) == unroll
  for other in ((False, True), (True, False)):
    for a, b in zip(results[True, True], results[other]):
      assert a.token_ids == b.token_ids
      np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_TOL)


def test_ragged_lists_group_a_rows_pages_into_entries():
  """Entries of up to `group` consecutive pages of one row; null pages fill a row's last."""
  flat = ragged.build([[5, 6, 7, 8, 9], [3, 4]], [17, 3], 2, 4, 5, group=2)
  assert flat.page_PY.tolist() == [[5, 6], [7, 8], [9, 0], [3, 0], [0, 0]]
  assert flat.row_P.tolist() == [0, 0, 0, 1, 1]
  assert flat.block_P.tolist() == [0, 2, 4, 0, -1]
  assert ragged.count([17, 3], 4, group=2) == 4
  # a token's page, looked up in the entries; block 1 of row 1 is not listed
  block_BT = jnp.asarray([[0, 3, 4], [0, 1, 1]])
  assert ragged.pages_of_tokens(jax.tree.map(jnp.asarray, flat), block_BT).tolist() == [
      [5, 8, 9], [3, 0, 0]]


def test_ragged_lists_refuse_what_does_not_fit():
  with pytest.raises(ValueError, match="3 entries of the pages in use do not fit a ragged "
                                       "list of 2"):
    ragged.build([[1, 2], [3]], [8, 1], 2, 4, 2, group=1)
  with pytest.raises(ValueError, match="2 entries .* do not fit a ragged list of 1"):
    ragged.build([[1, 2], [3]], [8, 1], 2, 4, 1)
  with pytest.raises(ValueError, match="row 1 holds 9 tokens but its table lists 1 pages"):
    ragged.build([[1, 2], [3]], [8, 9], 2, 4, 8)
  with pytest.raises(ValueError, match="3 tables and 3 ends for 2 rows"):
    ragged.build([[1], [2], [3]], [1, 1, 1], 2, 4, 8)


def test_ragged_decode_needs_a_float_pool():
  with pytest.raises(ValueError, match="ragged_decode reads a float pool in place"):
    PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, ragged_decode=True,
                kv_dtype="int8")
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, kv_dtype="int8")
  assert not engine.ragged_decode  # on its own it keeps int8 pages on the tables


def test_decode_shapes_are_the_ragged_sizes():
  engine = PagedEngine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=4,
                       block_size=4, ragged_decode=True)
  decode = [(w, s) for rows, t, w, s in engine.step_shapes() if t == 1]
  # at most 4 rows x 16 pages, in entries of 4 pages; a 4-page table gives at most 4 entries
  assert decode == [(0, s) for s in (4, 8, 10, 12, 14, 16)]
  assert PagedEngine._ragged_cap(4, 16) == 16 and PagedEngine._ragged_cap(4, 5) == 8
  assert PagedEngine._ragged_size(17, 64) == 20 and PagedEngine._ragged_size(17, 32) == 20


def test_shared_prefix_pages_are_listed_per_row_and_precompiled(model, monkeypatch):
  """Four rows share a prompt's first 4 pages through the prefix cache: the flat list names
  them once per row, 32 pages (8 entries) from a pool of 20, a length precompile() covers."""
  prefix = PROMPTS[2][:16]
  prompts = [prefix + [(5 * i + j) % 64 for j in range(4)] for i in range(4)]
  params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
  results = {}
  for way in (True, False):
    engine = PagedEngine(model, CharTokenizer(), max_seq_len=64, max_batch=4, block_size=4,
                         num_blocks=20, prefill_chunk=16, ragged_decode=way)
    engine.generate([prefix + [1]], params)  # seals the prefix's pages
    if way:
      assert engine.precompile() == len(engine.step_shapes())
      monkeypatch.setattr(infer.serving, "_step", None)  # nothing may compile from here on
    results[way] = engine.generate(prompts, params)
    monkeypatch.undo()
    counters = engine.counters()
    assert counters["prefix_cache_hits"] >= 4 * 4 and counters["preemptions"] == 0
  for a, b in zip(results[True], results[False]):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_TOL)
