"""Speculative decoding: greedy output is the target's, sampling keeps the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

from infer import Engine, SamplingParams, generate
from infer.drafts import lookup, lookup_on_device, sampling_probs
from infer.sampling import RowParams
from infer.speculative import (ModelDraft, PromptLookupDraft, SpeculativeDecoder, accept,
                               seen_with_drafts)
from models import ModelConfig, Transformer
from test_kv_cache import CFG, CharTokenizer, tiny_model

# The last prompt repeats itself, so prompt lookup has something to find from the start. All
# fit one prefill bucket (16): every compilation costs seconds on a small CPU.
PROMPTS = [[5, 9, 2], list(range(1, 15)), [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
N = 24
ALPHA = 1e-3  # significance of the chi-square tests (the seeds are fixed: a failure is a bug)


@pytest.fixture(scope="module")
def target():
  return tiny_model()


@pytest.fixture(scope="module")
def draft_model():
  """Another tiny model: different weights, the same 64-token vocabulary. (The same shape
  as the target, so it shares the target's compilations: the draft's size only matters for
  speed, which the benchmark measures.)"""
  return Transformer(ModelConfig(**CFG), nnx.Rngs(1))


@pytest.fixture(scope="module")
def engine(target):
  return Engine(target, CharTokenizer(), max_seq_len=64, max_batch=4)


@pytest.fixture(scope="module")
def plain(engine):
  """The target's greedy outputs from the KV-cached Engine."""
  return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=N))]


def _decoder(target, draft_model, kind, gamma=3, **kw):
  draft = ModelDraft(draft_model) if kind == "model" else PromptLookupDraft(max_ngram=3)
  return SpeculativeDecoder(target, draft, gamma=gamma, max_seq_len=64, **kw)


# Adaptive runs move gamma through 1..3 (gamma = 1 is a draft scan of length 0).
@pytest.mark.parametrize("kind,gamma,adaptive", [("model", 3, False), ("model", 3, True),
                                                 ("lookup", 3, False), ("lookup", 3, True)])
def test_greedy_output_is_the_targets_token_for_token(target, draft_model, plain, kind, gamma,
                                                      adaptive):
  decoder = _decoder(target, draft_model, kind, gamma, adaptive=adaptive)
  for prompt, expected in zip(PROMPTS, plain):
    ids, stats = decoder.generate(prompt, SamplingParams(max_tokens=N))
    assert ids == expected, prompt
    assert stats.finish_reason == "length" and stats.tokens == N
    assert all(1 <= g <= gamma or (kind == "lookup" and g == 0) for g in stats.gammas)
  assert ids == generate(target, PROMPTS[-1], N)  # and the cache-free reference agrees
  if adaptive and kind == "model":
    assert len(set(stats.gammas)) > 1  # gamma moved


def test_greedy_with_a_repetition_penalty_is_the_engines(target, draft_model, engine):
  """Greedy verification skips the filters' sort; the penalty must still apply, per position."""
  params = SamplingParams(max_tokens=N, repetition_penalty=1.8, top_k=5)
  expected = [r.token_ids for r in engine.generate(PROMPTS, params)]
  assert expected != [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=N))]
  for kind in ("model", "lookup"):
    decoder = _decoder(target, draft_model, kind)
    assert [decoder.generate(p, params)[0] for p in PROMPTS] == expected, kind


def test_stop_tokens_end_the_output_after_the_stop_token(target, draft_model, plain):
  expected = plain[1]
  stop = expected[5]
  cut = expected[:expected.index(stop) + 1]
  by_eos = _decoder(target, draft_model, "model", eos_id=stop)
  ids, stats = by_eos.generate(PROMPTS[1], SamplingParams(max_tokens=N))
  assert ids == cut and stats.finish_reason == "stop"
  ids, _ = by_eos.generate(PROMPTS[1], SamplingParams(max_tokens=N, ignore_eos=True))
  assert ids == expected
  ids, _ = _decoder(target, draft_model, "lookup").generate(
      PROMPTS[1], SamplingParams(max_tokens=N, stop_token_ids=(stop,)))
  assert ids == cut


def _chi2_pvalue(counts, probs):
  support = probs > 0
  assert counts[~support].sum() == 0, "a token the target never samples was emitted"
  expected = probs[support] / probs[support].sum() * counts.sum()
  return scipy_stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["sampled_q", "one_hot_q"])
def test_acceptance_rule_emits_the_target_distribution(one_hot_q):
  """100k vmapped rounds of 2 drafts over 8 tokens: the first emitted token follows p_1,
  the second (when draft 1 was kept) p_2, the bonus (both kept) p_3; chi-square at ALPHA."""
  v, draws = 8, 100_000
  p_TV = jnp.asarray([[.30, .20, .15, .10, .10, .08, .07, 0.],
                      [.05, .05, .40, .10, .10, .10, .10, .10],
                      [.125] * 8])
  q_YV = jnp.asarray([[.05, .05, .10, .40, .10, .10, .10, .10],   # TV(p_1, q_1) = 0.5
                      [.30, .20, .15, .10, .10, .08, .07, 0.]])
  if one_hot_q:  # a prompt-lookup draft: certain tokens
    q_YV = jax.nn.one_hot(jnp.asarray([3, 2]), v)

  def round_(key):
    draft_key, accept_key = jax.random.split(key)
    drafts_Y = jax.random.categorical(draft_key, jnp.log(q_YV)).astype(jnp.int32)
    n, token = accept(p_TV, q_YV, drafts_Y, accept_key)
    return n, jnp.where(n > 0, drafts_Y[0], token), jnp.where(n > 1, drafts_Y[1], token), token

  n, first, second, last = jax.jit(jax.vmap(round_))(jax.random.split(jax.random.key(0), draws))
  n, first, second, last = map(np.asarray, (n, first, second, last))
  p = np.asarray(p_TV, np.float64)
  counts = lambda x: np.bincount(x, minlength=v)
  assert _chi2_pvalue(counts(first), p[0]) > ALPHA
  assert _chi2_pvalue(counts(second[n >= 1]), p[1]) > ALPHA
  assert _chi2_pvalue(counts(last[n == 2]), p[2]) > ALPHA
  # Draft 1 is kept with probability sum(min(p_1, q_1)); binomial sd ~0.0016.
  np.testing.assert_allclose(np.mean(n >= 1), np.minimum(p[0], np.asarray(q_YV[0])).sum(),
                             atol=0.01)


def test_greedy_acceptance_is_argmax_matching():
  p_TV = jax.nn.one_hot(jnp.asarray([2, 5, 1]), 8)
  rule = jax.jit(accept)
  for drafts, n_expected, token in (([2, 5], 2, 1), ([2, 4], 1, 5), ([3, 5], 0, 2)):
    q_YV = jax.nn.one_hot(jnp.asarray(drafts), 8)
    n, out = rule(p_TV, q_YV, jnp.asarray(drafts), jax.random.key(1))
    assert (int(n), int(out)) == (n_expected, token)
  n, out = rule(p_TV, q_YV, jnp.asarray([2, 5]), jax.random.key(1), 1)
  assert (int(n), int(out)) == (1, 5)  # a padded draft is never kept


def test_seen_sets_follow_the_real_drafts():
  """Row i of seen_with_drafts is the text's seen set plus drafts 1..i, padding ignored."""
  v = 9
  seen_1V = jnp.zeros((1, v), bool).at[0, 7].set(True)
  for drafts, n_drafts in (([3, 3, 5, 0], 4), ([3, 3, 5, 0], 2), ([4, 1, 4, 2], 0),
                           ([8, 2, 8, 6], 3), ([3, 5, 3, 0], 1)):
    got = np.asarray(jax.jit(seen_with_drafts)(seen_1V, jnp.asarray(drafts), n_drafts))
    want = np.zeros((len(drafts) + 1, v), bool)
    want[:, 7] = True
    for i in range(1, len(drafts) + 1):
      want[i:, [d for d in drafts[:min(i, n_drafts)]]] = True
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_sampled_first_token_follows_the_target_distribution(target, draft_model, kind):
  """2000 seeds of the whole decoder (temperature 1, top-k 8): a different model's 3 drafts,
  or prompt lookup's (on the device) on a prompt that repeats itself, so it always drafts.

  With n draws over K = 8 tokens, E[TV(empirical, p)] <= 0.5 * sqrt(K / n) = 0.032, and
  McDiarmid (one draw moves TV by <= 1/n) gives P(TV > E + 0.045) <= exp(-2 n 0.045^2) = 3e-4:
  threshold 0.077. Sampling the draft's own distribution instead would be off by TV(p, q),
  asserted to be far larger.
  """
  prompt, draws = (PROMPTS[0] if kind == "model" else PROMPTS[3]), 2000
  params = dict(max_tokens=1, temperature=1.0, top_k=8)
  rows = RowParams.stack([SamplingParams(**params)])
  seen = jnp.zeros((1, 64), bool).at[0, jnp.asarray(prompt)].set(True)
  p_of = lambda m: np.asarray(sampling_probs(m(jnp.asarray([prompt]))[:, -1], seen, rows))[0]
  p = p_of(target)
  if kind == "model":
    q = p_of(draft_model)
  else:  # a lookup draft is certain: q is one-hot at the token it copies
    q = np.eye(64)[lookup(prompt, 3, max_ngram=3)[0]]
  decoder = _decoder(target, draft_model, kind)
  firsts = [decoder.generate(prompt, SamplingParams(seed=s, **params))[0][0] for s in range(draws)]
  empirical = np.bincount(firsts, minlength=64) / draws
  assert 0.5 * np.abs(empirical - p).sum() < 0.077
  assert 0.5 * np.abs(q - p).sum() > 0.3


def test_acceptance_counts_are_consistent(target, draft_model):
  same = SpeculativeDecoder(target, ModelDraft(target), gamma=3, max_seq_len=64)
  _, stats = same.generate(PROMPTS[1], SamplingParams(max_tokens=N))
  assert stats.accepted_Y == stats.proposed_Y == [N // 4] * 3 and stats.target_passes == N // 4
  assert stats.acceptance_rate() == 1.0 and stats.tokens_per_pass() == 4.0
  assert stats.draft_passes == 3 * stats.target_passes
  # Sampling with a repetition penalty: the draft's q matches p only if both track `seen` alike.
  hot = SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=4)
  _, stats = same.generate(PROMPTS[1], hot)
  assert stats.accepted_Y == stats.proposed_Y
  for kind in ("model", "lookup"):
    _, stats = _decoder(target, draft_model, kind).generate(PROMPTS[3], SamplingParams(
        max_tokens=N))
    assert all(a <= p for a, p in zip(stats.accepted_Y, stats.proposed_Y))
    assert stats.accepted_Y == sorted(stats.accepted_Y, reverse=True)  # kept in order
    assert stats.target_passes == len(stats.gammas) and 0 < stats.tokens_per_pass() <= 4
    info = stats.to_dict()
    assert len(info["per_position_rate"]) == 3 and info["tokens"] == N


def test_sampling_is_reproducible_per_seed(target, draft_model):
  decoder = _decoder(target, draft_model, "model")
  run = lambda seed: decoder.generate(PROMPTS[0], SamplingParams(
      max_tokens=N, temperature=1.0, seed=seed, logprobs=True))
  (a, sa), (b, sb), (c, _) = run(7), run(7), run(8)
  assert a == b and sa.logprobs == sb.logprobs and len(sa.logprobs) == N and a != c


def test_prompt_lookup_finds_the_most_recent_longest_match():
  assert lookup([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 3, max_ngram=3) == [4, 8, 1]
  assert lookup([7, 1, 2, 3, 5, 1, 2, 3], 2, max_ngram=3) == [5, 1]  # 3-gram [1, 2, 3]
  assert lookup([1, 2, 3, 4], 3, max_ngram=3) == []
  assert lookup([5, 5], 4, max_ngram=3) == [5]


def test_lookup_on_the_device_is_the_reference_lookup():
  """The jnp lookup the device loop runs against `lookup`, on random texts over 4 tokens
  (so n-grams recur, or not, at every length) with garbage past the text."""
  rng = np.random.default_rng(0)
  y, s = 6, 40
  fn = jax.jit(lookup_on_device, static_argnames=("y", "max_ngram", "min_ngram"))
  checked = 0
  for max_ngram, min_ngram in ((3, 1), (3, 2), (1, 1), (4, 4)):
    for length in range(1, s - y):
      tokens_S = rng.integers(0, 4, s).astype(np.int32)
      for gamma in (1, 3, y):
        expected = lookup(tokens_S[:length].tolist(), gamma, max_ngram, min_ngram)
        drafts_Y, k = fn(jnp.asarray(tokens_S), length, gamma, y=y, max_ngram=max_ngram,
                         min_ngram=min_ngram)
        assert int(k) == len(expected), (length, gamma, max_ngram, min_ngram)
        assert np.asarray(drafts_Y).tolist() == expected + [0] * (y - len(expected))
        checked += bool(expected)
  assert checked > 200  # most cases found a match: the comparison is not all misses


def test_lookup_logprobs_are_the_engines(target, engine):
  params = SamplingParams(max_tokens=N, logprobs=True)
  decoder = SpeculativeDecoder(target, PromptLookupDraft(max_ngram=3), gamma=3, max_seq_len=64)
  for prompt, result in zip(PROMPTS, engine.generate(PROMPTS, params)):
    ids, stats = decoder.generate(prompt, params)
    assert ids == result.token_ids
    np.testing.assert_allclose(stats.logprobs, result.logprobs, atol=1e-5)


class HostLookup(ModelDraft):
  """Prompt lookup proposed from the host, as before its rounds moved to the device: the
  decoder drives it round by round (`_rounds`), so the two paths can be compared."""

  def __init__(self, target, width, max_ngram=3):
    self.cfg, self.width, self.max_ngram, self.passes = target.cfg, width, max_ngram, 0

  def start(self, prompt_ids, cache_len):
    pass

  def propose(self, tokens, gamma, seen_1V, rows, step):
    drafts = lookup(tokens, gamma, self.max_ngram)
    padded = drafts + [0] * (self.width - len(drafts)) if drafts else []  # the loop's shapes
    return jnp.asarray(padded, jnp.int32), len(drafts), None

  def accepted(self, n):
    pass


def test_lookup_rounds_on_the_device_are_the_host_rounds(target, plain):
  """Greedy and sampled, with a repetition penalty, adaptive gamma and stop ids: the device
  loop makes the host loop's rounds (drafts proposed and kept), tokens, log-probabilities and
  finish. (A wrong step in gamma's rule, or a round key off by one, fails this.)"""
  kw = dict(gamma=3, max_seq_len=64, adaptive=True)
  host = SpeculativeDecoder(target, HostLookup(target, 3), **kw)
  device = SpeculativeDecoder(target, PromptLookupDraft(max_ngram=3), **kw)
  finishes, gammas = set(), set()
  for temperature, seed in ((0.0, 0), (1.0, 0), (1.0, 1), (1.0, 2)):
    for prompt, expected in zip(PROMPTS, plain):
      # up to 40 tokens: long enough for lookup to find the text's loops and gamma to climb
      params = SamplingParams(max_tokens=40, temperature=temperature, top_p=0.9,
                              repetition_penalty=1.3, seed=seed, logprobs=True,
                              stop_token_ids=(expected[4],))
      (a, sa), (b, sb) = host.generate(prompt, params), device.generate(prompt, params)
      assert a == b and sa.gammas == sb.gammas, (seed, prompt)
      assert sa.accepted_Y == sb.accepted_Y and sa.finish_reason == sb.finish_reason
      np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-6)
      finishes.add(sb.finish_reason)
      gammas.update(sb.gammas)
  assert finishes == {"stop", "length"} and {1, 2, 3} <= gammas  # both ends, and gamma moved


def test_policy_replay_counts_the_decoders_passes(target, draft_model, plain):
  """benchmarks/lookup_policy.py prices greedy lookup by replaying it on the output text."""
  from benchmarks.lookup_policy import replay
  decoder = _decoder(target, draft_model, "lookup")  # gamma 3, n-grams 3..1
  passes = sum(decoder.generate(p, SamplingParams(max_tokens=N))[1].target_passes
               for p in PROMPTS)
  assert replay(list(zip(PROMPTS, plain)), 3, 3, 1, {1: 1.0, 4: 1.0})[0] == passes


def test_bad_inputs_raise_value_errors(target, draft_model):
  lk = PromptLookupDraft()
  for gamma in (0, 2.5, 17):
    with pytest.raises(ValueError, match="gamma"):
      SpeculativeDecoder(target, lk, gamma=gamma)
  wide = Transformer(ModelConfig(**{**CFG, "vocab_size": 32}), nnx.Rngs(0))
  with pytest.raises(ValueError, match="vocabulary mismatch.*32.*64"):
    SpeculativeDecoder(target, ModelDraft(wide))
  with pytest.raises(ValueError, match="max_seq_len=65"):
    SpeculativeDecoder(target, lk, max_seq_len=65)
  with pytest.raises(ValueError, match="ModelDraft or PromptLookupDraft"):
    SpeculativeDecoder(target, draft_model)
  with pytest.raises(ValueError, match="max_ngram"):
    PromptLookupDraft(max_ngram=0)
  decoder = SpeculativeDecoder(target, lk, max_seq_len=32)
  cases = [([], {}, "empty prompt"), ([1] * 20, dict(max_tokens=13), "exceeds max_seq_len=32"),
           ([1, 64], {}, "token id 64 is outside"), ([1], dict(stop=("x",)), "stop strings"),
           ([1], dict(temperature=-1.0), "temperature")]
  for prompt, kw, message in cases:
    with pytest.raises(ValueError, match=message):
      decoder.generate(prompt, SamplingParams(**kw))
