"""OpenAI response bodies and stream chunks, built from the engine's Tokens (infer/requests.py).

A `Choice` gathers one choice's streamed Tokens; the same object makes the
non-streamed body at the end and the stream chunks on the way, so the streamed
text is the non-streamed text by construction.
"""

import json
import time
import uuid

from infer.requests import Token


def new_id(kind: str) -> str:
  return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


class Choice:
  """One choice's tokens so far; `index` is its place in the response's choices."""

  def __init__(self, index: int, tokenizer, logprobs: int | None):
    self.index, self.tokenizer, self.logprobs = index, tokenizer, logprobs
    self.text = ""
    self.tokens: list[Token] = []
    self.finish_reason: str | None = None
    self.error: str | None = None

  def add(self, token: Token) -> None:
    if token.finish_reason == "error":
      self.finish_reason = "error"
      return
    self.tokens.append(token)
    self.text += token.text
    self.finish_reason = token.finish_reason

  @property
  def completion_tokens(self) -> int:
    return len(self.tokens)

  def _piece(self, token_id: int) -> str:
    return self.tokenizer.decode([token_id], skip_special_tokens=False)

  def completion_logprobs(self, tokens: list[Token], offset: int) -> dict | None:
    """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    if self.logprobs is None:
      return None
    pieces = [self._piece(t.token_id) for t in tokens]
    offsets, at = [], offset
    for piece in pieces:
      offsets.append(at)
      at += len(piece)
    top = None
    if self.logprobs:
      top = [{self._piece(i): lp for i, lp in (t.top_logprobs or ())} for t in tokens]
    return {"tokens": pieces, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": top, "text_offset": offsets}

  def chat_logprobs(self, tokens: list[Token]) -> dict | None:
    """/v1/chat/completions' logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if self.logprobs is None:
      return None

    def entry(token_id, logprob):
      piece = self._piece(token_id)
      return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [dict(entry(t.token_id, t.logprob), top_logprobs=[
        entry(i, lp) for i, lp in (t.top_logprobs or ())]) for t in tokens]}


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
  completion = sum(c.completion_tokens for c in choices)
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
          "total_tokens": prompt_tokens + completion}


def response(kind: str, rid: str, model: str, fingerprint: str, choices: list[Choice],
             prompt_tokens: int) -> dict:
  """The non-streamed body."""
  out = []
  for c in choices:
    if kind == "completion":
      out.append({"index": c.index, "text": c.text,
                  "logprobs": c.completion_logprobs(c.tokens, 0),
                  "finish_reason": c.finish_reason})
    else:
      out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": c.chat_logprobs(c.tokens), "finish_reason": c.finish_reason})
  return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
          "created": int(time.time()), "model": model, "system_fingerprint": fingerprint,
          "choices": out, "usage": usage(prompt_tokens, choices)}


class ChunkWriter:
  """Server-sent events of one streamed response, in OpenAI's chunk format."""

  def __init__(self, kind: str, rid: str, model: str, fingerprint: str):
    self.kind, self.rid, self.model, self.fingerprint = kind, rid, model, fingerprint
    self.created = int(time.time())
    self.object = "text_completion" if kind == "completion" else "chat.completion.chunk"
    self._offsets: dict[int, int] = {}

  def _event(self, choices: list[dict], **extra) -> bytes:
    chunk = {"id": self.rid, "object": self.object, "created": self.created,
             "model": self.model, "system_fingerprint": self.fingerprint, "choices": choices}
    chunk.update(extra)
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

  def role(self, choice: Choice) -> bytes:
    """Chat's first chunk of a choice: the assistant role and no content yet."""
    return self._event([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])

  def delta(self, choice: Choice, token: Token) -> bytes | None:
    """The chunk for one token (None when it adds nothing to say)."""
    finish = choice.finish_reason if token.finish_reason else None
    if not token.text and finish is None and choice.logprobs is None:
      return None  # held back (a partial character or a possible stop string)
    tokens = [token] if token.finish_reason != "error" else []
    if self.kind == "completion":
      at = self._offsets.get(choice.index, 0)
      self._offsets[choice.index] = at + len(token.text)
      body = {"index": choice.index, "text": token.text,
              "logprobs": choice.completion_logprobs(tokens, at), "finish_reason": finish}
    else:
      body = {"index": choice.index, "delta": {"content": token.text} if token.text else {},
              "logprobs": choice.chat_logprobs(tokens), "finish_reason": finish}
    return self._event([body])

  def usage(self, prompt_tokens: int, choices: list[Choice]) -> bytes:
    return self._event([], usage=usage(prompt_tokens, choices))

  @staticmethod
  def error(message: str, type: str = "server_error", code: int = 500) -> bytes:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"

  @staticmethod
  def done() -> bytes:
    return b"data: [DONE]\n\n"
