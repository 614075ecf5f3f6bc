"""Draft proposers for speculative decoding (infer/speculative.py drives them).

A model draft has three methods, called once per request / round by the decoder:

  start(prompt_ids, cache_len)        a new request
  propose(tokens, gamma, seen_1V, rows, step) -> (drafts_Y, k, q_YV or None)
                                      k <= gamma tokens that follow `tokens`
                                      (prompt + generated so far), drafts_Y[:k]
                                      (padded to gamma, or empty when k = 0),
                                      and the distributions they were drawn
                                      from; None means each draft is certain
                                      (q one-hot)
  accepted(n)                         the target kept the first n drafts

and a `passes` counter of its own forward passes.

`ModelDraft` samples from a smaller model under the request's own sampling
parameters (so q is comparable to the target's p); `PromptLookupDraft` copies
what followed the most recent earlier occurrence of the text's last n-gram. Its
drafts cost no forward pass, so the decoder runs its rounds on the device: it
has `propose_on_device(tokens_S, length, gamma, y) -> (drafts_Y, k)` instead
(`lookup_on_device`, whose readable reference is `lookup`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import kv_cache
from infer.sampling import filtered_logits, greedy_tokens, mark_seen

DRAFT_STREAM, ACCEPT_STREAM = 1, 2  # independent random streams within one round


def round_key(seed, step, stream):
  """The key of one random stream of the round that generates token `step` of a request."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


def sampling_probs(logits_BV, seen_BV, rows):
  """The distribution each row samples from (float32): softmax of filtered_logits, or, for a
  greedy row (temperature 0), one-hot at the argmax `sample` would pick."""
  v = logits_BV.shape[-1]

  def filtered(_):
    filtered_BV = filtered_logits(logits_BV, seen_BV, rows)
    greedy_BV = jax.nn.one_hot(jnp.argmax(filtered_BV, axis=-1), v)
    return jnp.where(rows.temperature_B[:, None] > 0, jax.nn.softmax(filtered_BV, axis=-1),
                     greedy_BV)

  def greedy(_):
    return jax.nn.one_hot(greedy_tokens(logits_BV, seen_BV, rows), v)

  return jax.lax.cond(jnp.all(rows.temperature_B == 0), greedy, filtered, None)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def prefill(graphdef, state, prompt_1T, *, length, max_len):
  """(A cache of max_len slots holding prompt_1T[:, :length - 1], the prompt's seen set)."""
  model = nnx.merge(graphdef, state)
  slots_1T = jnp.arange(prompt_1T.shape[1])[None]
  _, cache = kv_cache.forward(model, prompt_1T, (slots_1T < length - 1).astype(jnp.int32),
                              kv_cache.init(model.cfg, 1, max_len))
  return cache, mark_seen(jnp.zeros((1, model.cfg.vocab_size), bool), prompt_1T, slots_1T < length)


def padded_prompt(prompt_ids, cache_len):
  """The prompt as a [1, T] array, T bucketed (kv_cache.bucket) so few prefills compile."""
  tokens_1T = np.zeros((1, kv_cache.bucket(len(prompt_ids), cache_len)), np.int32)
  tokens_1T[0, :len(prompt_ids)] = prompt_ids
  return jnp.asarray(tokens_1T)


@functools.partial(jax.jit, static_argnames=("graphdef", "gamma"), donate_argnames=("cache",))
def _propose(graphdef, state, cache, keep_1, catchup_1T, catchup_segment_ids_1T, seen_1V, rows,
             step, *, gamma):
  """gamma draft tokens and their q: cut the cache back to the verified text, feed the
  (1 or 2) verified tokens it lacks, then sample and feed one token at a time."""
  model = nnx.merge(graphdef, state)
  cache = kv_cache.truncate(cache, keep_1)
  logits_1V, cache = kv_cache.forward(model, catchup_1T, catchup_segment_ids_1T, cache)
  key = round_key(rows.seed_B[0], step, DRAFT_STREAM)
  one = jnp.ones((1, 1), jnp.int32)

  def draw(logits_1V, seen_1V, i):
    q_1V = sampling_probs(logits_1V, seen_1V, rows)
    token_1 = jax.random.categorical(jax.random.fold_in(key, i), jnp.log(q_1V)).astype(jnp.int32)
    return token_1, q_1V, mark_seen(seen_1V, token_1[:, None], one > 0)

  def body(carry, i):
    logits_1V, cache, seen_1V = carry
    token_1, q_1V, seen_1V = draw(logits_1V, seen_1V, i)
    logits_1V, cache = kv_cache.forward(model, token_1[:, None], one, cache)
    return (logits_1V, cache, seen_1V), (token_1[0], q_1V[0])

  # The last draft is never fed: the target verifies it, and only if it is kept does the
  # next round's catch-up chunk feed it here.
  (logits_1V, cache, seen_1V), (drafts_Y, q_YV) = jax.lax.scan(
      body, (logits_1V, cache, seen_1V), jnp.arange(gamma - 1))
  last_1, q_1V, _ = draw(logits_1V, seen_1V, gamma - 1)
  return jnp.concatenate([drafts_Y, last_1]), jnp.concatenate([q_YV, q_1V]), cache


class ModelDraft:
  """A smaller Transformer with the target's vocabulary, with its own KV cache.

  Its cache holds a prefix of the verified text; each round it is cut back to
  what the target kept (kv_cache.truncate) before the missing tokens are fed.
  """

  def __init__(self, model):
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    self.passes = 0
    self._cache = None

  def start(self, prompt_ids, cache_len):
    # The last prompt token is fed by the first proposal.
    self._cache, _ = prefill(self.graphdef, self.state, padded_prompt(prompt_ids, cache_len),
                             length=len(prompt_ids), max_len=cache_len)
    self._valid = len(prompt_ids) - 1  # tokens at the front of the cache the target verified
    self.passes += 1

  def propose(self, tokens, gamma, seen_1V, rows, step):
    catchup = list(tokens[self._valid:])
    if not 1 <= len(catchup) <= 2:
      raise RuntimeError(f"draft cache out of sync: {len(catchup)} tokens to catch up")
    pad = 2 - len(catchup)  # one chunk shape whether or not the last round kept every draft
    catchup_1T = jnp.asarray([catchup + [0] * pad], jnp.int32)
    segment_ids_1T = jnp.asarray([[1] * len(catchup) + [0] * pad], jnp.int32)
    drafts_Y, q_YV, self._cache = _propose(
        self.graphdef, self.state, self._cache, jnp.asarray([self._valid], jnp.int32),
        catchup_1T, segment_ids_1T, seen_1V, rows, step, gamma=gamma)
    self._fed = (len(tokens), gamma)
    self.passes += gamma
    return drafts_Y, gamma, q_YV

  def accepted(self, n):
    # The cache now holds `tokens` and drafts 1..gamma-1; the kept ones stay.
    length, gamma = self._fed
    self._valid = length + min(n, gamma - 1)


def lookup(tokens, gamma, max_ngram, min_ngram=1):
  """Prompt lookup: for n = max_ngram down to min_ngram, the (up to) gamma tokens that followed
  the most recent earlier occurrence of the last n tokens; [] when no n-gram recurs."""
  arr = np.asarray(tokens, np.int64)
  for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # excludes the suffix itself
    hits = np.flatnonzero(np.all(windows == arr[-n:], axis=1))
    if hits.size:
      start = hits[-1] + n
      return arr[start:start + gamma].tolist()
  return []


def lookup_on_device(tokens_S, length, gamma, y, max_ngram, min_ngram=1):
  """`lookup` in jnp, for a loop on the device: the first `length` of tokens_S are the text
  (the rest is ignored), gamma <= y (static) may be traced. Returns (drafts_Y, k):
  drafts_Y[:k] the proposal, zeros after; k = 0 when no n-gram recurs. tokens_S needs
  y slots to spare past `length` (dynamic_slice would shift a slice that runs off the end)."""
  j_S = jnp.arange(tokens_S.shape[0])
  start, found = jnp.int32(0), jnp.bool_(False)
  for n in range(max_ngram, min_ngram - 1, -1):
    suffix = jax.lax.dynamic_slice(tokens_S, (jnp.maximum(length - n, 0),), (n,))  # n tokens
    # window j = tokens[j:j + n], excluding the suffix itself (j + n <= length - 1)
    match_S = j_S <= length - 1 - n
    for i in range(n):  # tokens_S[j + i]; j + i < length, so the roll never wraps
      match_S &= jnp.roll(tokens_S, -i) == suffix[i]
    hit = jnp.max(jnp.where(match_S, j_S, -1))  # the most recent occurrence
    start = jnp.where(~found & (hit >= 0), hit + n, start)
    found |= hit >= 0
  k = jnp.where(found, jnp.minimum(gamma, length - start), 0).astype(jnp.int32)
  drafts_Y = jax.lax.dynamic_slice(tokens_S, (start,), (y,))
  return jnp.where(jnp.arange(y) < k, drafts_Y, 0), k


class PromptLookupDraft:
  """Proposes by copying earlier text (prompt + output): free, strong when the output quotes
  its input (edits, summaries, code). Its drafts are certain: q is one-hot.

  Its rounds run on the device (SpeculativeDecoder calls `propose_on_device` inside one
  jitted loop per request), so it has no host-side `propose`. Equal settings compare equal:
  the draft is a static argument of that loop."""

  def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
    if not 1 <= min_ngram <= max_ngram:
      raise ValueError(f"PromptLookupDraft needs 1 <= min_ngram ({min_ngram}) <= max_ngram "
                       f"({max_ngram})")
    self.max_ngram, self.min_ngram = max_ngram, min_ngram
    self.passes = 0

  def _key(self):
    return type(self), self.max_ngram, self.min_ngram

  def __eq__(self, other):
    return isinstance(other, PromptLookupDraft) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def start(self, prompt_ids, cache_len):
    pass

  def propose_on_device(self, tokens_S, length, gamma, y):
    """(drafts_Y, k) for the text tokens_S[:length]: `lookup_on_device`."""
    return lookup_on_device(tokens_S, length, gamma, y, self.max_ngram, self.min_ngram)

  def accepted(self, n):
    pass
