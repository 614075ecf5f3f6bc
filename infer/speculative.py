"""Speculative decoding: a cheap draft proposes gamma tokens, the target verifies them in one pass.

    decoder = SpeculativeDecoder(target, PromptLookupDraft(max_ngram=3), gamma=4)
    token_ids, stats = decoder.generate(prompt_ids, SamplingParams(max_tokens=128))

Each round (Leviathan et al. 2023; Chen et al. 2023), with x the last token of
the text (not yet in the target's cache) and d1..dk the drafts (k <= gamma):

  1. the target runs once on [x, d1..dk] (kv_cache.forward, all_logits) and
     gets p_1..p_{k+1}, its sampling distributions after each prefix;
  2. `accept`: d_i is kept with probability min(1, p_i(d_i)/q_i(d_i)) until
     the first rejection, which is replaced by a sample of norm(max(0, p - q));
     if all k are kept, a bonus token is sampled from p_{k+1};
  3. the target cache is cut back to the kept tokens (kv_cache.truncate).

p and q are the *filtered* distributions (softmax of `filtered_logits`, after
repetition penalty, temperature, top-k/p, min-p), so the output follows the
target's sampling distribution exactly; at temperature 0 both are one-hot and
the output is the target's greedy output token for token. Randomness is
fold_in(fold_in(key(seed), step), stream) with step the index of the round's
first new token: reproducible per request, independent of the draft's stream.

One request at a time (batch 1). A model draft's rounds are driven from the
host, one `_verify` call per round; prompt lookup's run all on the device, the
n-gram match included (`_lookup_rounds`: one call per request, no dispatch or
transfer per round). Shapes are static per gamma (short lookup proposals are
padded to gamma, a lookup miss verifies just x, through a `lax.cond`), so jit
compiles one loop, or one verification and one draft variant, per gamma value.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import kv_cache
from infer.engine import Engine, unrolls
# `stop_ids` is a local name below
from infer.requests import check_request, stop_ids as request_stop_ids
from infer.drafts import (ACCEPT_STREAM, ModelDraft, PromptLookupDraft, padded_prompt, prefill,
                          round_key, sampling_probs)
from infer.sampling import RowParams, SamplingParams, mark_seen
from models import layer_weights

__all__ = ["SpeculativeDecoder", "SpecStats", "ModelDraft", "PromptLookupDraft", "accept"]
MAX_GAMMA = 16
NO_RESIDUAL = 1e-6  # mass below which max(0, p - q) is rounding noise: p and q agree


def accept(p_TV, q_YV, drafts_Y, key, n_drafts=None):
  """The exact acceptance rule: (n kept drafts, the token that follows them).

  p_TV: target probabilities after each of the T = Y + 1 prefixes; q_YV: the
  draft's, from which drafts_Y were sampled; only the first n_drafts (default
  all) are real. The emitted tokens, drafts_Y[:n] then `token`, are
  distributed as sequential samples from p.
  """
  y = drafts_Y.shape[0]
  valid_Y = jnp.arange(y) < (y if n_drafts is None else n_drafts)
  q_YV = jnp.where(valid_Y[:, None], q_YV, 0.0)  # past the drafts, the residual is p itself
  u_key, r_key = jax.random.split(key)
  p_x_Y = p_TV[jnp.arange(y), drafts_Y]
  q_x_Y = q_YV[jnp.arange(y), drafts_Y]
  # u < p/q without dividing (q(x) > 0: x was drawn from q); as u < 1, p(x) >= q(x) always keeps.
  kept_Y = (jax.random.uniform(u_key, (y,)) * q_x_Y < p_x_Y) & valid_Y
  n = jnp.sum(jnp.cumprod(kept_Y.astype(jnp.int32)))
  q_TV = jnp.concatenate([q_YV, jnp.zeros_like(p_TV[:1])])  # q = 0 after the last draft: bonus
  residual_V = jnp.maximum(p_TV[n] - q_TV[n], 0.0)
  residual_V = jnp.where(jnp.sum(residual_V) > NO_RESIDUAL, residual_V, p_TV[n])
  return n, jax.random.categorical(r_key, jnp.log(residual_V)).astype(jnp.int32)


def seen_with_drafts(seen_1V, drafts_Y, n_drafts):
  """[Y + 1, V]: row i is the seen set of the text plus drafts 1..i (the first n_drafts are
  real), for the repetition penalty at each verified position."""
  t, v = drafts_Y.shape[0] + 1, seen_1V.shape[-1]
  # A token is seen from the position after its first real draft on. (A cumsum of the
  # drafts' one-hots lowers to a reduce-window on CPU: 7 ms of a 60 ms SmolLM2 pass.)
  from_Y = jnp.where(jnp.arange(t - 1) < n_drafts, jnp.arange(1, t), t)
  first_V = jnp.full((v,), t, jnp.int32).at[drafts_Y].min(from_Y)
  return seen_1V | (jnp.arange(t)[:, None] >= first_V[None, :])


def verify(model, cache, last_1, drafts_Y, n_drafts, q_YV, seen_1V, rows, step):
  """One target pass over [last, drafts[:n_drafts]] (the rest is padding):
  (n, emitted_T, logprobs_T, cache, seen_1V); emitted_T[:n + 1] are the new tokens."""
  t, v = drafts_Y.shape[0] + 1, model.cfg.vocab_size
  chunk_1T = jnp.concatenate([last_1, drafts_Y])[None]
  real_1T = (jnp.arange(t) <= n_drafts).astype(jnp.int32)[None]
  logits_1TV, cache = kv_cache.forward(model, chunk_1T, real_1T, cache, all_logits=True)
  drafted_YV = jax.nn.one_hot(drafts_Y, v, dtype=jnp.int32) * real_1T[0, 1:, None]
  seen_TV = seen_with_drafts(seen_1V, drafts_Y, n_drafts)
  rows_T = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), rows)
  p_TV = sampling_probs(logits_1TV[0], seen_TV, rows_T)
  q_YV = drafted_YV.astype(jnp.float32) if q_YV is None else q_YV
  n, token = accept(p_TV, q_YV, drafts_Y, round_key(rows.seed_B[0], step, ACCEPT_STREAM),
                    n_drafts)
  emitted_T = jnp.where(jnp.arange(t) < n, jnp.concatenate([drafts_Y, last_1]), token)
  logprobs_T = jnp.take_along_axis(jax.nn.log_softmax(logits_1TV[0], axis=-1),
                                   emitted_T[:, None], axis=-1)[:, 0]
  cache = kv_cache.truncate(cache, cache.lengths_B - n_drafts + n)  # drop the rejected drafts
  seen_1V = mark_seen(seen_1V, emitted_T[None], (jnp.arange(t) <= n)[None])
  return n, emitted_T, logprobs_T, cache, seen_1V


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache", "seen_1V"))
def _verify(graphdef, weights, cache, last_1, drafts_Y, n_drafts, q_YV, seen_1V, rows, step):
  """`verify` as one call: a round driven from the host (a model draft)."""
  return verify(layer_weights.merge(graphdef, weights), cache, last_1, drafts_Y, n_drafts, q_YV,
                seen_1V, rows, step)


@functools.partial(jax.jit, static_argnames=("graphdef", "draft", "gamma", "adaptive"),
                   donate_argnames=("cache", "seen_1V"))
def _lookup_rounds(graphdef, weights, cache, seen_1V, tokens_S, length, max_tokens, stop_O, rows,
                   *, draft, gamma, adaptive):
  """A whole request's rounds with a draft that proposes on the device (prompt lookup), in one
  `lax.while_loop`: the host's loop below, without a dispatch and a transfer per round.

  tokens_S holds the prompt (`length` tokens) and room for the output plus 2 * (gamma + 1)
  slots. Returns (tokens_S, logprobs_S, end, rounds, k_R, n_R, finish, cache, seen_1V): the
  output is tokens_S[prompt:end]; round r proposed k_R[r] drafts and kept n_R[r] (both padded
  to S entries: a round makes at least one token); finish 1 = a stop token, 2 = max_tokens.
  The cache and seen set come back only so that the donated inputs' buffers can serve the loop.
  """
  model = layer_weights.merge(graphdef, weights)
  t, prompt = gamma + 1, length

  def body(carry):
    r, cache, seen_1V, tokens_S, logprobs_S, length, g, _, k_R, n_R = carry
    step = length - prompt  # tokens generated so far: the round's key
    drafts_Y, k = draft.propose_on_device(tokens_S, length, g, gamma)
    last_1 = jax.lax.dynamic_slice(tokens_S, (length - 1,), (1,))

    def drafted(cache, seen_1V):
      return verify(model, cache, last_1, drafts_Y, k, None, seen_1V, rows, step)

    def missed(cache, seen_1V):  # no n-gram recurs: verify the last token alone, as the host did
      n, emitted_1, logprobs_1, cache, seen_1V = verify(model, cache, last_1, drafts_Y[:0], 0,
                                                        None, seen_1V, rows, step)
      pad = lambda a: jnp.pad(a, (0, gamma))
      return n, pad(emitted_1), pad(logprobs_1), cache, seen_1V

    n, emitted_T, logprobs_T, cache, seen_1V = jax.lax.cond(k > 0, drafted, missed, cache,
                                                            seen_1V)
    # The first of emitted_T[:n + 1] that is a stop token or the max_tokens-th ends the request.
    i_T = jnp.arange(t)
    stop_T = jnp.any(emitted_T[:, None] == stop_O[None], axis=1)
    end_T = (i_T <= n) & (stop_T | (step + i_T + 1 >= max_tokens))
    e = jnp.argmax(end_T)
    finish = jnp.where(jnp.any(end_T), jnp.where(stop_T[e], 1, 2), 0).astype(jnp.int32)
    tokens_S = jax.lax.dynamic_update_slice(tokens_S, emitted_T, (length,))
    logprobs_S = jax.lax.dynamic_update_slice(logprobs_S, logprobs_T, (length,))
    if adaptive:  # a miss (k = 0) says nothing about gamma
      g = jnp.where(k == 0, g, jnp.where(n == k, jnp.minimum(g + 1, gamma),
                                         jnp.where(n == 0, jnp.maximum(g - 1, 1), g)))
    return (r + 1, cache, seen_1V, tokens_S, logprobs_S,
            length + jnp.where(finish > 0, e + 1, n + 1), g, finish, k_R.at[r].set(k),
            n_R.at[r].set(n))

  s = tokens_S.shape[0]
  carry = (jnp.int32(0), cache, seen_1V, tokens_S, jnp.zeros((s,), jnp.float32), length,
           jnp.int32(gamma), jnp.int32(0), jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.int32))
  r, cache, seen_1V, tokens_S, logprobs_S, end, _, finish, k_R, n_R = jax.lax.while_loop(
      lambda c: c[7] == 0, body, carry)
  return tokens_S, logprobs_S, end, r, k_R, n_R, finish, cache, seen_1V


@dataclasses.dataclass
class SpecStats:
  """Counts of one request. Position i (0-based) is draft i + 1 of a round; a round's
  drafts are counted as the rule judged them, even past max_tokens or a stop token."""
  proposed_Y: list[int]
  accepted_Y: list[int]
  target_passes: int = 0  # verification passes (plus one prefill per request)
  draft_passes: int = 0   # draft forward passes (0 for prompt lookup)
  tokens: int = 0         # tokens returned
  finish_reason: str = ""
  logprobs: list[float] | None = None
  gammas: list[int] = dataclasses.field(default_factory=list)  # drafts proposed each round

  def per_position_rate(self) -> list[float | None]:
    return [a / p if p else None for a, p in zip(self.accepted_Y, self.proposed_Y)]

  def acceptance_rate(self) -> float | None:
    return sum(self.accepted_Y) / sum(self.proposed_Y) if sum(self.proposed_Y) else None

  def mean_accepted(self) -> float:
    """Drafts kept per target pass."""
    return sum(self.accepted_Y) / max(self.target_passes, 1)

  def tokens_per_pass(self) -> float:
    return self.tokens / max(self.target_passes, 1)

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(per_position_rate=self.per_position_rate(), acceptance_rate=self.acceptance_rate(),
               mean_accepted=self.mean_accepted(), tokens_per_pass=self.tokens_per_pass())
    return out


class SpeculativeDecoder:
  """Speculative generation of one request at a time; see the module docstring.

  draft: ModelDraft(smaller_model) or PromptLookupDraft(). gamma: drafts per
  round; with adaptive, gamma is the maximum and each round's moves in
  [1, gamma]: +1 after all drafts were kept, -1 after the first was rejected.
  eos_id (unless params.ignore_eos) and params.stop_token_ids end generation;
  the stop token is the last one returned, as in Engine.
  """

  def __init__(self, target, draft, gamma: int = 4, max_seq_len: int | None = None, *,
               adaptive: bool = False, eos_id: int | None = None,
               unroll_layers: bool | None = None):
    cfg = target.cfg
    draft_cfg = getattr(draft, "cfg", cfg)
    if cfg.arch != "decoder" or draft_cfg.arch != "decoder":
      raise ValueError("speculative decoding serves decoder-only models: target arch="
                       f"{cfg.arch!r}, draft arch={draft_cfg.arch!r} (both must be 'decoder')")
    if not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= MAX_GAMMA:
      raise ValueError(f"gamma={gamma!r} must be an integer in [1, {MAX_GAMMA}]")
    if not isinstance(draft, (ModelDraft, PromptLookupDraft)):
      raise ValueError(f"draft must be a ModelDraft or PromptLookupDraft, not {type(draft)}")
    max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
    limits = [("target", cfg.max_seq_len)]
    if isinstance(draft, ModelDraft):
      if draft.cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"vocabulary mismatch: the draft model has {draft.cfg.vocab_size} "
                         f"tokens, the target {cfg.vocab_size}")
      limits.append(("draft", draft.cfg.max_seq_len))
    for name, limit in limits:
      if not 0 < max_seq_len <= limit:
        raise ValueError(f"max_seq_len={max_seq_len} must be in [1, the {name} model's "
                         f"max_seq_len={limit}]")
    self.draft, self.gamma, self.adaptive, self.eos_id = draft, int(gamma), adaptive, eos_id
    self.vocab_size, self.max_seq_len = cfg.vocab_size, max_seq_len
    # Drafts past the last verified token need room too (they may be cut after the fact).
    self.cache_len = max_seq_len + self.gamma
    # the target's rounds run its layers unrolled as infer.Engine's decode steps do (None: on
    # CPU); its prefill and the draft model scan
    self.unroll_layers = unrolls(unroll_layers)
    self.graphdef, self.state = nnx.split(target)

  state = Engine.state  # assigning new weights unstacks them again at the next request
  weights = Engine.weights

  def check(self, prompt_ids, params: SamplingParams) -> None:
    """Raises ValueError naming the problem with a request."""
    check_request(prompt_ids, params, self.max_seq_len, self.vocab_size)
    if params.stop:
      raise ValueError("stop strings need text; SpeculativeDecoder works on token ids: use "
                       "stop_token_ids")

  def generate(self, prompt_ids, params: SamplingParams | None = None):
    """(new token ids, SpecStats) for one prompt (a list of token ids)."""
    params = params or SamplingParams()
    prompt_ids = [int(t) for t in prompt_ids]
    self.check(prompt_ids, params)
    stop_ids = set(params.stop_token_ids)
    if self.eos_id is not None and not params.ignore_eos:
      stop_ids.add(self.eos_id)
    rows = RowParams.stack([params])
    # The target's cache holds all but the last prompt token: the first round feeds that one.
    cache, seen_1V = prefill(self.graphdef, self.state, padded_prompt(prompt_ids, self.cache_len),
                             length=len(prompt_ids), max_len=self.cache_len)
    self.draft.start(prompt_ids, self.cache_len)
    passes0 = self.draft.passes
    rounds = self._device_rounds if isinstance(self.draft, PromptLookupDraft) else self._rounds
    out, logprobs, k_R, n_R, finish = rounds(prompt_ids, params, rows, cache, seen_1V, stop_ids)
    stats = SpecStats([0] * self.gamma, [0] * self.gamma, target_passes=len(k_R),
                      draft_passes=self.draft.passes - passes0, tokens=len(out),
                      finish_reason=finish, logprobs=logprobs if params.logprobs else None,
                      gammas=list(k_R))
    for k, n in zip(k_R, n_R):
      for i in range(k):
        stats.proposed_Y[i] += 1
        stats.accepted_Y[i] += i < n
    return out, stats

  def _rounds(self, prompt_ids, params, rows, cache, seen_1V, stop_ids):
    """The rounds driven from the host, one `_verify` call each (a model draft):
    (output, its logprobs, drafts proposed and kept per round, finish reason)."""
    tokens, out, logprobs, gamma = list(prompt_ids), [], [], self.gamma
    k_R, n_R, finish = [], [], ""
    while not finish:
      drafts_Y, k, q_YV = self.draft.propose(tokens, gamma, seen_1V, rows, len(out))
      n, emitted_T, logprobs_T, cache, seen_1V = _verify(
          self.graphdef, self.weights(), cache, jnp.asarray(tokens[-1:], jnp.int32), drafts_Y, k,
          q_YV, seen_1V, rows, len(out))
      n = int(n)
      self.draft.accepted(n)
      k_R.append(k)
      n_R.append(n)
      new = np.asarray(emitted_T)[:n + 1].tolist()
      for token, logprob in zip(new, np.asarray(logprobs_T).tolist()):
        out.append(token)
        logprobs.append(logprob)
        if token in stop_ids:
          finish = "stop"
        elif len(out) >= params.max_tokens:
          finish = "length"
        if finish:
          break
      tokens.extend(new)
      if self.adaptive and k:  # a draft that found nothing (k = 0) says nothing about gamma
        gamma = min(gamma + 1, self.gamma) if n == k else max(gamma - 1, 1) if n == 0 else gamma
    return out, logprobs, k_R, n_R, finish

  def _device_rounds(self, prompt_ids, params, rows, cache, seen_1V, stop_ids):
    """`_rounds` for prompt lookup: all rounds in one `_lookup_rounds` call."""
    p = len(prompt_ids)
    tokens_S = np.zeros(self.cache_len + 2 * (self.gamma + 1), np.int32)
    tokens_S[:p] = prompt_ids
    stop_O = request_stop_ids([stop_ids], 1, self.vocab_size)[0]
    *out, _, _ = _lookup_rounds(
        self.graphdef, self.weights(), cache, seen_1V, jnp.asarray(tokens_S), jnp.int32(p),
        jnp.int32(params.max_tokens), jnp.asarray(stop_O), rows, draft=self.draft,
        gamma=self.gamma, adaptive=self.adaptive)
    tokens_S, logprobs_S, end, r, k_R, n_R, finish = jax.device_get(out)
    return (tokens_S[p:end].tolist(), logprobs_S[p:end].tolist(), k_R[:r].tolist(),
            n_R[:r].tolist(), {1: "stop", 2: "length"}[int(finish)])
