"""A request's host-side life: checked on arrival (`check_request`), its tokens and text as
they come and its stop conditions (`Request`), and what it returns (`Result`, streamed
`Token`s); `stop_ids` lays the rows' stop token ids out for the device. The `Engine`, the
`PagedEngine` and the encoder-decoder engine keep a `Request` per request; speculative
decoding checks its requests and stop ids here."""

import dataclasses

import numpy as np

from infer.sampling import SamplingParams


@dataclasses.dataclass
class Result:
  """One request's output. finish_reason: "stop", "length" or "error" (then `error` says why)."""
  text: str
  token_ids: list[int]
  logprobs: list[float] | None
  finish_reason: str
  error: str | None = None
  prompt_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Token:
  """A streamed token. `text` is what it adds to the output, possibly "" while held back
  (an incomplete UTF-8 character, or a possible start of a stop string); the
  last Token carries the finish_reason and flushes what was held back."""
  token_id: int
  text: str
  logprob: float | None
  finish_reason: str | None = None
  # (token_id, logprob) of the most likely tokens, best first, when params.top_logprobs > 0
  top_logprobs: tuple[tuple[int, float], ...] | None = None


class Request:
  """Host-side state of one request: its tokens so far, its text, and whether it has finished."""

  def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_id: int | None, tokenizer):
    self.prompt_ids, self.params, self.tokenizer = prompt_ids, params, tokenizer
    self.stop_ids = set(params.stop_token_ids)
    if eos_id is not None and not params.ignore_eos:
      self.stop_ids.add(eos_id)
    self.token_ids: list[int] = []
    self.logprobs: list[float] = []
    self.text = ""
    self.emitted = ""
    self.finish_reason: str | None = None
    self.error: str | None = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def add(self, token_id: int, logprob: float, top=None) -> Token:
    """Appends a sampled token, checks the stop conditions, returns the streamed delta."""
    if not np.isfinite(logprob):  # a broken checkpoint: say so rather than emit garbage
      self.finish_reason = "error"
      self.error = f"the model produced non-finite logits (token {len(self.token_ids)})"
      return Token(token_id, "", None, "error")
    self.token_ids.append(token_id)
    self.logprobs.append(logprob)
    stopped_by_token = token_id in self.stop_ids
    # The stop token is in token_ids but not in the text.
    self.text = self.tokenizer.decode(self.token_ids[:-1] if stopped_by_token else self.token_ids)
    cuts = [i for i in (self.text.find(s) for s in self.params.stop) if i >= 0]
    if cuts:
      self.text = self.text[:min(cuts)]
    if stopped_by_token or cuts:
      self.finish_reason = "stop"
    elif len(self.token_ids) >= self.params.max_tokens:
      self.finish_reason = "length"
    visible = self.text if self.done else self._settled()
    delta = visible[len(self.emitted):] if len(visible) > len(self.emitted) else ""
    self.emitted = max(self.emitted, visible, key=len)
    top = tuple(top[:self.params.top_logprobs]) if top and self.params.top_logprobs else None
    return Token(token_id, delta, logprob if self.params.logprobs else None, self.finish_reason,
                 top)

  def _settled(self) -> str:
    """The text minus what may still change: a partial character or a stop string's start."""
    text = self.text.rstrip("\ufffd")
    hold = max([n for s in self.params.stop for n in range(1, len(s))
                if text.endswith(s[:n])], default=0)
    return text[:len(text) - hold]

  def result(self) -> Result:
    return Result(self.text, self.token_ids, self.logprobs if self.params.logprobs else None,
                  self.finish_reason, self.error, prompt_tokens=len(self.prompt_ids))


def stop_ids(id_sets, b: int, vocab_size: int) -> np.ndarray:
  """stop_BO: each row's stop token ids (one set per request) within the vocabulary (no
  other can be sampled), -1 padding to a power of two, so few widths compile."""
  ids = [sorted(t for t in s if 0 <= t < vocab_size) for s in id_sets]
  o = max([len(i) for i in ids] + [1])
  stop_BO = np.full((b, 1 << (o - 1).bit_length()), -1, np.int32)
  for row, i in enumerate(ids):
    stop_BO[row, :len(i)] = i
  return stop_BO


def check_request(prompt_ids: list[int], params: SamplingParams, max_seq_len: int,
                  vocab_size: int) -> None:
  """Raises ValueError naming the limit a request breaks."""
  params.validate()
  n, s = len(prompt_ids), max_seq_len
  if n == 0:
    raise ValueError("empty prompt: a request needs at least one prompt token")
  if n >= s:
    raise ValueError(f"prompt of {n} tokens is longer than the context: max_seq_len={s} "
                     "(which must also leave room for one new token)")
  if n + params.max_tokens > s:
    raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                     f"{n + params.max_tokens} exceeds max_seq_len={s}")
  bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def batch_of_requests(prompts, params):
  """(single, prompts, params): one request or a list of them, with one SamplingParams each."""
  single = isinstance(prompts, str) or (len(prompts) > 0
                                        and isinstance(prompts[0], (int, np.integer)))
  prompts = [prompts] if single else list(prompts)
  if params is None or isinstance(params, SamplingParams):
    params = [params or SamplingParams()] * len(prompts)
  if len(params) != len(prompts):
    raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
  return single, prompts, params
