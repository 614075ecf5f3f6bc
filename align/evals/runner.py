"""The model under evaluation as a chat responder: greedy, batched, and hard to break.

Every suite asks its questions through `ChatModel.respond`, one call per batch of
conversations, so every suite decodes the same way (infer.Engine, greedy: the same model
gives the same answers). A model may answer with nothing, loop until the token limit, or
produce text that is mostly noise; none of that stops an evaluation:

- the answer is cut at `max_new_tokens` (finish_reason "length"), its text at `max_chars`
  (`clipped`), so no scorer sees an enormous string;
- `degenerate` marks looping text (few distinct word 4-grams), counted in the report;
- a conversation the engine cannot take (too long after keeping its end, bad ids) comes
  back as finish_reason "error" with empty text instead of raising.

Models without a chat template (small models trained here from scratch) read the plain
"User: ...\nAssistant:" transcript.
"""

import dataclasses

from infer import Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class Response:
  text: str
  finish_reason: str  # "stop", "length" or "error"
  tokens: int
  degenerate: bool = False
  clipped: bool = False
  error: str | None = None


def is_degenerate(text: str, n: int = 4, min_grams: int = 16, max_unique: float = 0.3) -> bool:
  """Looping text: at least `min_grams` word n-grams, of which under `max_unique` distinct."""
  words = text.split()
  grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
  if len(grams) < min_grams:
    # a long run of one character (no spaces) loops too
    return len(text) >= 200 and len(set(text)) <= 3
  return len(set(grams)) / len(grams) < max_unique


def plain_transcript(conversation: list[dict]) -> str:
  lines = [f"{m['role'].capitalize()}: {m['content']}" for m in conversation]
  return "\n".join(lines) + "\nAssistant:"


class ChatModel:
  """Greedy chat answers of a meshlm decoder (see the module docstring)."""

  def __init__(self, model, tokenizer, *, max_new_tokens: int = 128, batch_size: int = 8,
               max_prompt_tokens: int = 768, max_chars: int = 4000, name: str = ""):
    if max_new_tokens < 1 or batch_size < 1 or max_prompt_tokens < 1 or max_chars < 1:
      raise ValueError(f"ChatModel limits must be >= 1: max_new_tokens={max_new_tokens}, "
                       f"batch_size={batch_size}, max_prompt_tokens={max_prompt_tokens}, "
                       f"max_chars={max_chars}")
    self.model, self.tokenizer, self.name = model, tokenizer, name
    limit = model.cfg.max_seq_len
    self.max_new_tokens = min(max_new_tokens, limit - 1)
    self.max_prompt_tokens = min(max_prompt_tokens, limit - self.max_new_tokens)
    self.max_chars = max_chars
    self.engine = Engine(model, tokenizer, max_seq_len=min(limit, self.max_prompt_tokens +
                                                          self.max_new_tokens),
                         max_batch=batch_size)
    self.params = SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0)

  def prompt_ids(self, conversation: list[dict]) -> list[int]:
    """The model's input for a conversation; a long one keeps its end (the last question)."""
    for m in conversation:
      if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
          "system", "user", "assistant"):
        raise ValueError(f"bad chat message {str(m)[:80]!r}: needs role and string content")
    if self.tokenizer.chat_template:
      ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(conversation), add_bos=False)
    else:
      ids = self.tokenizer.encode(plain_transcript(conversation))
    return ids[-self.max_prompt_tokens:]

  def respond(self, conversations: list[list[dict]]) -> list[Response]:
    """One greedy answer per conversation, in order; never raises for a bad conversation."""
    prompts, out = [], [None] * len(conversations)
    for i, conv in enumerate(conversations):
      try:
        prompts.append((i, self.prompt_ids(conv)))
      except (ValueError, TypeError, KeyError) as e:
        out[i] = Response("", "error", 0, error=str(e))
    results = (self.engine.generate([ids for _, ids in prompts], self.params,
                                    progress=f"answers {self.name}".strip())
               if prompts else [])
    for (i, _), r in zip(prompts, results):
      text = r.text
      clipped = len(text) > self.max_chars
      text = text[:self.max_chars]
      out[i] = Response(text, r.finish_reason, len(r.token_ids), is_degenerate(text), clipped,
                        r.error)
    return out

  def ask(self, prompts: list[str], system: str | None = None) -> list[Response]:
    """Single-turn questions."""
    pre = [{"role": "system", "content": system}] if system else []
    return self.respond([pre + [{"role": "user", "content": p}] for p in prompts])


def output_counts(responses) -> dict:
  """How many answers were empty, looping, clipped or failed: the report's robustness counts."""
  responses = list(responses)
  return {"responses": len(responses),
          "empty_outputs": sum(not r.text.strip() and r.finish_reason != "error"
                               for r in responses),
          "degenerate_outputs": sum(r.degenerate for r in responses),
          "clipped_outputs": sum(r.clipped for r in responses),
          "length_capped": sum(r.finish_reason == "length" for r in responses),
          "errors": sum(r.finish_reason == "error" for r in responses)}
