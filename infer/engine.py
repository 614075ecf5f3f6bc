"""The inference engine: batched, KV-cached generation behind `generate` and `stream`.

    engine = Engine(model, tokenizer, max_seq_len=1024, max_batch=8)
    results = engine.generate(["Hi", "Once upon"], SamplingParams(max_tokens=32))
    for token in engine.stream("Hi", SamplingParams(temperature=0.7, seed=1)):
      print(token.text, end="")

A batch of up to `max_batch` requests runs together: one jitted prefill over
the right-padded prompts (length bucketed by kv_cache.bucket: at least 16,
under 25% padding), or over the prompts packed into one row where that is
shorter (a decoder with a float cache), then decode steps of one token per row
for the whole batch (below), the cache donated from call to call: per row, the power of
two slots above the batch's longest prompt + max_tokens, at most `max_seq_len`
(infer/kv_cache.py; `kv_dtype="int8"` stores it as int8 with per-token
scales, about 1/4 of the float32 bytes; a sliding-window decoder's, a ring of twice the window
when that is fewer slots). A float cache read in place (several rows, or
unrolled layers) is read only up to the power of two above the batch's longest row
(`kv_cache.width_for`).
Each row's positions start at 0 and padding is never attended, so a request's
tokens do not depend on its batch-mates; its randomness depends on its own
seed only. Finished rows ride along masked until the whole batch is done.

`generate` runs up to `decode_steps` (16) decode steps per jitted call, in a
`lax.while_loop` that stops each row at its stop token ids or max_tokens, so
dispatch and the device-to-host transfer are paid once per call, not per token
(detokenising and the stop checks still run per token, between calls); `stream`
runs one step per call. Stop strings and the text are the host's: a row stopped
by a stop string runs on to the end of its call, the extra tokens ignored.

On CPU, with a float cache, the decode steps run the layers unrolled over per-layer weight
buffers (`unroll_layers`, models/layer_weights.py; a second copy of the layers' weights),
each writing its keys and values into the cache in place. Prefill keeps the layer scan: it
is compute-bound, and compiles once per prompt bucket, where unrolling would triple the
compile time of a deep model.
"""

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

import parallel
from infer import kv_cache, packed_prefill
from models import rope as rope_lib
from models import layer_weights
from infer.requests import Request, Result, Token, batch_of_requests, check_request, stop_ids
from infer.sampling import RowParams, SamplingParams, mark_seen, sample


def unrolls(unroll_layers: bool | None, kv_dtype: str | None = None) -> bool:
  """Whether decode steps run the layers unrolled: as asked, or (None) on CPU, where a scan
  copies each layer's weights out of the stack every step; measured with a float cache only
  (an int8 cache's unrolled steps restack its slices)."""
  if unroll_layers is not None:
    return bool(unroll_layers)
  return parallel.platform() == "cpu" and kv_dtype is None


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "kv_dtype"))
def _prefill(graphdef, state, tokens_BT, segment_ids_BT, rows, *, max_len, kv_dtype=None):
  model = nnx.merge(graphdef, state)
  cache = kv_cache.init(model.cfg, tokens_BT.shape[0], max_len, kv_dtype)
  logits_BV, cache = kv_cache.forward(model, tokens_BT, segment_ids_BT, cache)
  seen_BV = mark_seen(jnp.zeros(logits_BV.shape, bool), tokens_BT, segment_ids_BT > 0)
  token_B, logprob_B = sample(logits_BV, seen_BV, rows, jnp.zeros(tokens_BT.shape[:1], jnp.int32))
  return token_B, logprob_B, cache, mark_seen(seen_BV, token_B[:, None], segment_ids_BT[:, :1] > 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "batch", "max_len", "kv_dtype"))
def _prefill_packed(graphdef, state, tokens_1P, segment_ids_1P, positions_1P, row_P, last_B, rows,
                    *, batch, max_len, kv_dtype=None):
  model = nnx.merge(graphdef, state)
  cache = kv_cache.init(model.cfg, batch, max_len, kv_dtype)
  logits_BV, cache = packed_prefill.prefill_packed(model, tokens_1P, segment_ids_1P, positions_1P, row_P,
                                             last_B, cache)
  seen_BV = jnp.zeros(logits_BV.shape, bool).at[row_P, tokens_1P[0]].set(True, mode="drop")
  token_B, logprob_B = sample(logits_BV, seen_BV, rows, jnp.zeros((batch,), jnp.int32))
  return token_B, logprob_B, cache, mark_seen(seen_BV, token_B[:, None],
                                              (cache.lengths_B > 0)[:, None])


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "width"),
                   donate_argnames=("cache", "seen_BV"))
def _decode(graphdef, weights, cache, token_B, active_B, seen_BV, rows, step, count, stop_BO,
            left_B, *, steps, width=None):
  """Up to `count` (<= the static `steps`) decode steps in one call, from token index `step`:
  (tokens_IB, logprobs_IB, n, cache, seen_BV), rows [0, n) of the first two filled.

  A row stops at a token in its stop_BO (-1 pads) or after left_B more tokens, as
  `Request.add` decides on the host; the loop ends early once every row has. Stop strings
  are the host's alone: such a row runs on to the end of the call, its extra tokens ignored.
  """
  model = layer_weights.merge(graphdef, weights)
  b = token_B.shape[0]

  def body(carry):
    i, cache, token_B, active_B, seen_BV, left_B, tokens_IB, logprobs_IB = carry
    logits_BV, cache = kv_cache.forward(model, token_B[:, None],
                                        active_B[:, None].astype(jnp.int32), cache, width=width)
    token_B, logprob_B = sample(logits_BV, seen_BV, rows, jnp.full((b,), step + i, jnp.int32))
    seen_BV = mark_seen(seen_BV, token_B[:, None], active_B[:, None])
    left_B = left_B - 1
    done_B = (jnp.any(token_B[:, None] == stop_BO, axis=1) | (left_B <= 0)
              | ~jnp.isfinite(logprob_B))
    return (i + 1, cache, token_B, active_B & ~done_B, seen_BV, left_B,
            tokens_IB.at[i].set(token_B), logprobs_IB.at[i].set(logprob_B))

  carry = (jnp.int32(0), cache, token_B, active_B, seen_BV, left_B,
           jnp.zeros((steps, b), jnp.int32), jnp.zeros((steps, b), jnp.float32))
  n, cache, _, _, seen_BV, _, tokens_IB, logprobs_IB = jax.lax.while_loop(
      lambda c: (c[0] < count) & jnp.any(c[3]), body, carry)
  return tokens_IB, logprobs_IB, n, cache, seen_BV


class Engine:
  """KV-cached generation for a model and its tokenizer; see the module docstring."""

  ARCHS = ("decoder", "prefix_lm")  # a prefix-LM's prompt is its bidirectional prefix
  PACK_MAX = 1024  # the longest packed prefill row (see _packed)

  def __init__(self, model, tokenizer, max_seq_len: int | None = None, max_batch: int = 8, *,
               kv_dtype: str | None = None, decode_steps: int = 16,
               unroll_layers: bool | None = None):
    kv_cache.check_kv_dtype(kv_dtype)
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
      raise ValueError(f"Engine decode_steps={decode_steps!r} must be an integer >= 1")
    if model.cfg.arch not in self.ARCHS:
      raise ValueError(f"{type(self).__name__} serves arch {self.ARCHS}, not "
                       f"{model.cfg.arch!r} (encoder-decoder: infer.seq2seq; encoder: infer.embed)")
    limit = model.cfg.max_seq_len
    max_seq_len = limit if max_seq_len is None else max_seq_len
    if not 0 < max_seq_len <= limit:
      raise ValueError(f"Engine max_seq_len={max_seq_len} must be in [1, the model's "
                       f"max_seq_len={limit}]")
    if max_batch < 1:
      raise ValueError(f"Engine max_batch={max_batch} must be >= 1")
    self.tokenizer = tokenizer
    self.vocab_size, self.arch, self.cfg = model.cfg.vocab_size, model.cfg.arch, model.cfg
    self.max_seq_len, self.max_batch, self.kv_dtype = max_seq_len, max_batch, kv_dtype
    # decode steps per jitted call in `generate` (`stream` takes one at a time)
    self.decode_steps = decode_steps
    # keys, values (and int8 scales) of a full batch: the cache's peak footprint
    self.cache_bytes = kv_cache.cache_bytes(model.cfg, max_batch, max_seq_len, kv_dtype)
    self.unroll_layers = unrolls(unroll_layers, kv_dtype)
    self.graphdef, self.state = nnx.split(model)

  @property
  def state(self):
    """The model's (stacked) state. Assigning one (new weights, same tree) keeps the compiled
    steps; the per-layer copy the unrolled steps read is made again at the next batch."""
    return self._state

  @state.setter
  def state(self, state):
    self._state, self._weights = state, None

  def weights(self):
    """What the decode steps read: the state, or its layers unstacked (`unroll_layers`)."""
    if self._weights is None:
      self._weights = (layer_weights.unstack(self._state) if self.unroll_layers
                       else self._state)
    return self._weights

  def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
               progress: str | None = None) -> list[Result]:
    """Results in prompt order. `prompts`: a list of texts and/or token-id lists.

    A single request (a bare text or token-id list) raises ValueError when
    invalid; in a batch, an invalid request gets finish_reason "error" and the
    others are still served. `progress` names a progress bar over the prompts (on a
    terminal's stderr).
    """
    single, prompts, params = batch_of_requests(prompts, params)
    results: list[Result | None] = [None] * len(prompts)
    pending = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      try:
        pending.append((i, self._request(prompt, p)))
      except ValueError as e:
        if single:
          raise
        results[i] = Result("", [], None, "error", error=str(e))
    # Similar lengths share a batch, so little of the bucketed prefill is padding.
    pending.sort(key=lambda item: len(item[1].prompt_ids))
    with tqdm.tqdm(total=len(pending), desc=progress, unit="prompt", leave=False,
                   disable=None if progress else True) as bar:
      for start in range(0, len(pending), self.max_batch):
        chunk = pending[start:start + self.max_batch]
        for _ in self._run([r for _, r in chunk]):
          pass
        for i, r in chunk:
          results[i] = r.result()
        bar.update(len(chunk))
    return results

  def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[Token]:
    """Tokens of one request as they are generated; raises ValueError at once if it is invalid."""
    request = self._request(prompt, params or SamplingParams())

    def tokens():
      for step in self._run([request], per_token=True):
        yield from (token for _, token in step)

    return tokens()

  def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
    """Raises ValueError naming the limit a request breaks."""
    check_request(prompt_ids, params, self.max_seq_len, self.vocab_size)

  def _request(self, prompt, params: SamplingParams) -> Request:
    ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    self.check(ids, params)
    return Request(ids, params, self.tokenizer.eos_id, self.tokenizer)

  def _padded(self, requests: list[Request], limit: int):
    """(b, ids_BT, segment_ids_BT): the prompts right-padded to a bucketed length <= limit,
    the batch rounded up to a power of two (<= max_batch), so few shapes compile."""
    b = min(1 << (len(requests) - 1).bit_length(), self.max_batch)
    t = kv_cache.bucket(max(len(r.prompt_ids) for r in requests), limit)
    ids_BT = np.zeros((b, t), np.int32)
    segment_ids_BT = np.zeros((b, t), np.int32)
    for i, r in enumerate(requests):
      ids_BT[i, :len(r.prompt_ids)] = r.prompt_ids
      segment_ids_BT[i, :len(r.prompt_ids)] = 1
    return b, ids_BT, segment_ids_BT

  def _packed(self, requests: list[Request], b: int, padded_tokens: int, slots: int):
    """The prompts packed into one row for `_prefill_packed` (infer/packed_prefill.py), or None
    where that does not apply or saves nothing: it needs a decoder-only model and a float
    cache, and fewer tokens than padding every prompt to the longest. At most PACK_MAX
    tokens, since attention over the packed row computes (and masks) the scores between
    prompts too. Not where the mesh splits the batch: one packed row cannot be split, so
    every batch shard would compute the whole prefill. Nor where the packed row is longer
    than a sliding window's ring (`slots`): its prompts are prefilled in pieces instead. Nor
    where RoPE depends on a row's length (dynamic, longrope): one packed row is one length."""
    total = sum(len(r.prompt_ids) for r in requests)
    if (self.arch != "decoder" or self.kv_dtype is not None or total > self.PACK_MAX
        or parallel.shards_of("act_batch") > 1 or self.cfg.rope_scaling in rope_lib.BY_LENGTH):
      return None
    p = kv_cache.bucket(total, self.PACK_MAX)
    if p >= padded_tokens or (kv_cache.ring_slots(self.cfg) and p > slots):
      return None
    tokens, segments, positions = (np.zeros((1, p), np.int32) for _ in range(3))
    row_P, last_B = np.full((p,), b, np.int32), np.zeros((b,), np.int32)
    at = 0
    for i, r in enumerate(requests):
      m = len(r.prompt_ids)
      tokens[0, at:at + m], segments[0, at:at + m] = r.prompt_ids, i + 1
      positions[0, at:at + m], row_P[at:at + m], last_B[i] = np.arange(m), i, at + m - 1
      at += m
    return tuple(map(jnp.asarray, (tokens, segments, positions, row_P, last_B)))

  def _run(self, requests: list[Request], per_token: bool = False
           ) -> Iterator[list[tuple[Request, Token]]]:
    """Serves a batch (<= max_batch) to completion, yielding each step's new tokens: up to
    `decode_steps` steps per jitted call, or one with `per_token` (streaming)."""
    n = len(requests)
    # The batch's cache holds what its rows can reach (prompt + max_tokens), a power of two
    # <= max_seq_len, not max_seq_len itself: `Engine(model, tok)` sizes max_seq_len to the
    # model's whole context (8,192), and a cache that size per batch ran a 16-token prompt's
    # 64-token decode at 0.78-0.82x of max_seq_len=512 (issue 45). Few sizes, so few compilations.
    max_len = kv_cache.width_for(max(len(r.prompt_ids) + r.params.max_tokens for r in requests),
                                 self.max_seq_len)
    b, tokens_BT, segment_ids_BT = self._padded(requests, max_len)
    rows = RowParams.stack([r.params for r in requests] + [SamplingParams()] * (b - n))
    slots = kv_cache.slots_for(self.cfg, max_len)  # fewer than max_len for a sliding window
    packed = self._packed(requests, b, tokens_BT.size, slots)
    if packed is not None:
      token_B, logprob_B, cache, seen_BV = _prefill_packed(
          self.graphdef, self.state, *packed, rows, batch=b, max_len=max_len,
          kv_dtype=self.kv_dtype)
    else:
      token_B, logprob_B, cache, seen_BV = _prefill(
          self.graphdef, self.state, jnp.asarray(tokens_BT), jnp.asarray(segment_ids_BT), rows,
          max_len=max_len, kv_dtype=self.kv_dtype)
    carry = {"cache": cache, "seen": seen_BV}  # donated to each call, replaced by its result
    # Where the cache is read in place, a step reads only the slots in use. A one-row decode
    # over all S slots of the model's own max_seq_len (8,192) ran 5.6x slower than at 512
    # (issue 45): worth the one compilation per power-of-two width it costs.
    narrow = kv_cache.reads_in_place(b, self.kv_dtype == "int8", self.unroll_layers)
    stop_BO = jnp.asarray(stop_ids([r.stop_ids for r in requests], b, self.vocab_size))

    def advance(token_B, active_B, step):
      left_B = np.array([r.params.max_tokens - len(r.token_ids) if not r.done else 0
                         for r in requests] + [0] * (b - n), np.int32)
      count = 1 if per_token else min(self.decode_steps, int(left_B.max()))
      width = None
      if narrow:
        # Step s writes live row i's slot len(prompt_i) + s - 1 < max_seq_len: attend over
        # the power of two above, and end the call where the next step would need a wider
        # one. Finished rows (a longer prompt, perhaps) no longer count.
        reach = max(len(r.prompt_ids) for r in requests if not r.done) + step
        width = kv_cache.width_for(reach, slots)
        if reach <= slots:  # beyond, a sliding window's ring has wrapped: every slot is read
          count = min(count, width - reach + 1)
      tokens_IB, logprobs_IB, i, carry["cache"], carry["seen"] = _decode(
          self.graphdef, self.weights(), carry["cache"], token_B, active_B, carry["seen"], rows,
          step, count, stop_BO, left_B, steps=self.decode_steps, width=width)
      tokens_IB, logprobs_IB, i = jax.device_get((tokens_IB, logprobs_IB, i))
      return tokens_IB[:i], logprobs_IB[:i]

    yield from self._host_loop(requests, b, token_B, logprob_B, advance)

  @staticmethod
  def _host_loop(requests, b, token_B, logprob_B, advance):
    """The host side of one batch: hands each step's tokens to the requests and yields the
    streamed deltas until every request is done. `advance(token_B, active_B, step)` runs the
    next jitted step(s), from token index `step`, and returns (tokens_IB, logprobs_IB): I >= 1
    steps' tokens, taken in order; a row that finishes mid-way ignores the rest."""
    n, step = len(requests), 0
    tokens_IB, logprobs_IB = np.asarray(token_B)[None], np.asarray(logprob_B)[None]
    while True:
      if not len(tokens_IB):  # the loop ran no step: no progress would ever be made
        raise RuntimeError(f"a decode call from token {step} returned no tokens")
      for tokens_B, logprobs_B in zip(tokens_IB, logprobs_IB):
        live = [(i, r) for i, r in enumerate(requests) if not r.done]
        if not live:
          return
        yield [(r, r.add(int(tokens_B[i]), float(logprobs_B[i]))) for i, r in live]
      step += len(tokens_IB)
      active_B = np.array([not r.done for r in requests] + [False] * (b - n))
      if not active_B.any():
        return
      tokens_IB, logprobs_IB = advance(tokens_IB[-1], active_B, step)
