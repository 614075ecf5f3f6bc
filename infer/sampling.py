"""Sampling: request parameters, the batched token sampler, and a cache-free reference decoder.

`sample` turns one step's logits into tokens for a batch of requests, each
with its own parameters and seed; the KV-cached engine (infer/engine.py) and
the reference `generate` below share it, so the two differ only in how the
logits are computed. `generate` recomputes the whole (fixed-size) buffer every
step: slow, but it calls the training forward pass, so it is the yardstick the
cache is tested against.

Per-token log-probabilities are the log-softmax of the raw model logits (before
repetition penalty, temperature and filtering) at the chosen token: the
model's own probability of the text, whatever the sampler did.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_BUCKET = 64
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
CANDIDATES = 1024  # logits lax.top_k gathers for the top-k/top-p thresholds (filtered_logits)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is decoded. temperature 0 is greedy (argmax after the repetition penalty).

  Filters apply in this order, as in Hugging Face: repetition penalty (CTRL:
  a logit l of a token seen in the prompt or output becomes l/penalty if l > 0
  else l*penalty), temperature, top-k (0: off), top-p over what top-k kept
  (1: off), min-p (keep p >= min_p * p_max; 0: off). Generation stops at
  max_tokens ("length"), at a stop token id or the tokenizer's EOS unless
  ignore_eos, or when the text contains a stop string ("stop"; the text is cut
  before it). `seed` fixes the random stream of this request alone.
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  seed: int = 0
  logprobs: bool = False
  top_logprobs: int = 0  # also return this many most likely tokens per step (PagedEngine)

  def validate(self) -> None:
    """Raises ValueError naming the parameter and its allowed range."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "seed"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"sampling parameter {name}={value!r} must be a number")
    checks = [
        ("max_tokens", isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens > 0,
         "a positive integer"),
        ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
        ("top_k", isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0, ">= 0 (0 = off)"),
        ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
        ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)"),
        ("seed", 0 <= self.seed < 2 ** 32, "in [0, 2**32)"),
        ("top_logprobs", isinstance(self.top_logprobs, (int, np.integer))
         and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
    ]
    for name, ok, allowed in checks:
      if not ok:
        raise ValueError(f"sampling parameter {name}={getattr(self, name)!r} must be {allowed}")
    if not isinstance(self.stop, (list, tuple)) or not all(
        isinstance(s, str) and s for s in self.stop):
      raise ValueError(f"sampling parameter stop={self.stop!r} must be a list of non-empty "
                       "strings")
    if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
        isinstance(i, (int, np.integer)) for i in self.stop_token_ids):
      raise ValueError(f"sampling parameter stop_token_ids={self.stop_token_ids!r} must be a "
                       "list of token ids")


class RowParams(NamedTuple):
  """SamplingParams of a batch as per-row arrays, so one compiled sampler serves any mix."""
  temperature_B: jax.Array
  top_k_B: jax.Array
  top_p_B: jax.Array
  min_p_B: jax.Array
  penalty_B: jax.Array
  seed_B: jax.Array

  @classmethod
  def stack(cls, params: list[SamplingParams]) -> "RowParams":
    col = lambda name, dt: jnp.asarray(np.array([getattr(p, name) for p in params], dt))
    return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
               col("min_p", np.float32), col("repetition_penalty", np.float32),
               col("seed", np.uint32))


def penalised_logits(logits_BV, seen_BV, penalty_B) -> jax.Array:
  """float32 logits with the repetition penalty applied to the seen tokens."""
  logits_BV = logits_BV.astype(jnp.float32)
  penalty_B1 = penalty_B[:, None]
  penalised_BV = jnp.where(logits_BV > 0, logits_BV / penalty_B1, logits_BV * penalty_B1)
  return jnp.where(seen_BV, penalised_BV, logits_BV)


def greedy_tokens(logits_BV, seen_BV, rows: RowParams) -> jax.Array:
  """What a greedy row picks: the filters all keep the largest logit (and its ties), so the
  argmax after the repetition penalty alone, without sorting the vocabulary."""
  return jnp.argmax(penalised_logits(logits_BV, seen_BV, rows.penalty_B), axis=-1)


def _thresholds(sorted_BC, logits_BV, k_B, top_p_B):
  """(kth_B1, nth_B1, complete_B): the top-k and top-p thresholds read off the C largest
  logits `sorted_BC` (descending), and whether those C were enough to place them."""
  c, v = sorted_BC.shape[-1], logits_BV.shape[-1]
  max_B1 = sorted_BC[:, :1]
  kth_B1 = jnp.where((k_B == v)[:, None], jnp.min(logits_BV, axis=-1, keepdims=True),
                     jnp.take_along_axis(sorted_BC, jnp.minimum(k_B, c)[:, None] - 1, axis=-1))
  # The softmax over what top-k kept; its normaliser sums the whole vocabulary.
  z_B1 = jnp.sum(jnp.where(logits_BV >= kth_B1, jnp.exp(logits_BV - max_B1), 0.0), axis=-1,
                 keepdims=True)
  in_top_k_BC = sorted_BC >= kth_B1
  probs_BC = jnp.where(in_top_k_BC, jnp.exp(sorted_BC - max_B1), 0.0) / z_B1
  # Keep a token while the mass before it is < top_p: the smallest set reaching top_p.
  before_BC = jnp.cumsum(probs_BC, axis=-1) - probs_BC
  keep_B = jnp.sum(in_top_k_BC & (before_BC < top_p_B[:, None]), axis=-1)
  nth_B1 = jnp.take_along_axis(sorted_BC, jnp.maximum(keep_B, 1)[:, None] - 1, axis=-1)
  nth_B1 = jnp.where((top_p_B >= 1)[:, None], kth_B1, nth_B1)  # a rounded cumsum must not cut
  complete_B = ((k_B <= c) | (k_B == v)) & ((top_p_B >= 1) | (keep_B < c))
  return kth_B1, nth_B1, complete_B


def filtered_logits(logits_BV, seen_BV, rows: RowParams, candidates: int = CANDIDATES):
  """The logits a row samples from: penalised, tempered, filtered tokens at -inf (float32).

  Each filter is a threshold on the sorted logits (ties with the threshold are kept). Top-k
  and top-p read theirs off the `candidates` largest logits (lax.top_k), and sort the whole
  vocabulary only when a row's top-k or nucleus reaches past them: a sort of SmolLM2's 49k
  logits costs several times the model's decode step on CPU.
  """
  logits_BV = penalised_logits(logits_BV, seen_BV, rows.penalty_B)
  temperature_B1 = rows.temperature_B[:, None]
  logits_BV = logits_BV / jnp.where(temperature_B1 > 0, temperature_B1, 1.0)
  v = logits_BV.shape[-1]
  k_B = jnp.where(rows.top_k_B > 0, jnp.minimum(rows.top_k_B, v), v)

  def by_sorting():
    return _thresholds(-jnp.sort(-logits_BV, axis=-1), logits_BV, k_B, rows.top_p_B)[:2]

  def by_candidates():
    kth_B1, nth_B1, complete_B = _thresholds(jax.lax.top_k(logits_BV, candidates)[0],
                                             logits_BV, k_B, rows.top_p_B)
    return jax.lax.cond(jnp.all(complete_B), lambda: (kth_B1, nth_B1), by_sorting)

  def unfiltered():  # no row has top-k or top-p: both thresholds are the smallest logit
    min_B1 = jnp.min(logits_BV, axis=-1, keepdims=True)
    return min_B1, min_B1

  filtering = jnp.any((k_B < v) | (rows.top_p_B < 1))
  kth_B1, nth_B1 = jax.lax.cond(filtering, by_candidates if candidates < v else by_sorting,
                                unfiltered)
  # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); renormalising cannot change it.
  min_B1 = jnp.max(logits_BV, axis=-1, keepdims=True) + jnp.log(rows.min_p_B[:, None])
  keep_BV = (logits_BV >= kth_B1) & (logits_BV >= nth_B1) & (logits_BV >= min_B1)
  return jnp.where(keep_BV, logits_BV, -jnp.inf)


def sample(logits_BV, seen_BV, rows: RowParams, step_B):
  """(token_B, logprob_B) for one step; `step_B` is the index of the token being generated.

  Row b's randomness is fold_in(key(seed_b), step_b): it depends on its own
  seed and step only, never on the rest of the batch.
  """
  def any_sampled(_):
    filtered_BV = filtered_logits(logits_BV, seen_BV, rows)
    keys_B = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(rows.seed_B, step_B)
    sampled_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV)
    return jnp.where(rows.temperature_B > 0, sampled_B, jnp.argmax(filtered_BV, axis=-1))

  # An all-greedy batch skips the sort of the vocabulary (~9 ms a row for 49k tokens on CPU).
  token_B = jax.lax.cond(jnp.all(rows.temperature_B == 0),
                         lambda _: greedy_tokens(logits_BV, seen_BV, rows), any_sampled, None)
  token_B = token_B.astype(jnp.int32)
  logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  return token_B, jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]


def mark_seen(seen_BV, tokens_BT, valid_BT):
  """seen_BV with the valid tokens of each row set (for the repetition penalty)."""
  rows_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[0])[:, None], tokens_BT.shape)
  return seen_BV.at[rows_BT, tokens_BT].max(valid_BT)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _next_token(graphdef, state, buffer_1T, cursor, seen_1V, rows, step, prompt_len):
  model = nnx.merge(graphdef, state)
  if model.cfg.arch == "prefix_lm":  # the prompt is the bidirectional prefix, as in training
    prefix_1T = (jnp.arange(buffer_1T.shape[1]) < prompt_len).astype(jnp.int32)[None]
    logits_1TV = model(buffer_1T, prefix_BT=prefix_1T)
  else:
    logits_1TV = model(buffer_1T)
  logits_1V = jax.lax.dynamic_index_in_dim(logits_1TV, cursor - 1, axis=1, keepdims=False)
  token_1, logprob_1 = sample(logits_1V, seen_1V, rows, jnp.reshape(step, (1,)))
  return token_1[0], logprob_1[0]


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int = 0, eos_id: int | None = None,
             return_logprobs: bool = False):
  """The new token ids (with logprobs: (ids, logprobs)), stopping after `eos_id`.

  No KV cache: every step runs the training forward pass on the whole buffer,
  rounded up to a multiple of 64 so one compilation serves many lengths
  (causal masking makes the padding after the cursor inert). Where RoPE depends on the
  length (dynamic, longrope) every key is rotated afresh for the buffer's length each step,
  which a cached decoder (infer.Engine, transformers' generate) does not do.
  """
  if not prompt_ids:
    raise ValueError("generate needs a non-empty prompt")
  if model.cfg.arch not in ("decoder", "prefix_lm"):
    raise ValueError(f"generate continues decoder-only models; arch={model.cfg.arch!r} "
                     "(encoder-decoder: infer.seq2seq.Seq2SeqEngine)")
  params = SamplingParams(max_tokens=max(max_new_tokens, 1), temperature=temperature,
                          top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty, seed=seed)
  params.validate()
  total = len(prompt_ids) + max_new_tokens
  limit = model.cfg.max_seq_len
  if total > limit:
    raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                     f"the model's max_seq_len={limit}")
  length = min(-(-total // _BUCKET) * _BUCKET, max(limit, total))
  buffer = jnp.zeros((1, length), jnp.int32).at[0, :len(prompt_ids)].set(jnp.asarray(prompt_ids))
  seen = jnp.zeros((1, model.cfg.vocab_size), bool).at[0, jnp.asarray(prompt_ids)].set(True)
  rows = RowParams.stack([params])
  graphdef, state = nnx.split(model)
  new_ids, logprobs = [], []
  cursor = len(prompt_ids)
  for step in range(max_new_tokens):
    token, logprob = _next_token(graphdef, state, buffer, cursor, seen, rows, step,
                                 len(prompt_ids))
    token = int(token)
    new_ids.append(token)
    logprobs.append(float(logprob))
    if eos_id is not None and token == eos_id:
      break
    buffer = buffer.at[0, cursor].set(token)
    seen = seen.at[0, token].set(True)
    cursor += 1
  return (new_ids, logprobs) if return_logprobs else new_ids
