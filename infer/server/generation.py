"""`Server`: one completions or chat request from validated body to response or stream.

Route (stable or canary) -> tokenize with that version's tokenizer -> check the
context -> one engine request per prompt and choice -> collect or stream the
Tokens -> count metrics and feed the release monitors. Streaming and
non-streaming responses are built from the same `Choice` objects, so the streamed
text equals the non-streamed text under greedy decoding.
"""

import asyncio
import concurrent.futures
import logging
import random
import threading
import time

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from infer.server import app as app_lib
from infer.server import openai_format as fmt
from infer.server import protocol
from infer.server.protocol import ApiError, bad

log = logging.getLogger("meshlm.serve")


class _Stream(StreamingResponse):
  """Closes the event generator however the response ends (a client gone mid-stream too), so
  its `finally` frees the engine requests at once; `on_close` covers a generator that never
  started (aclose does not run its `finally` then)."""

  def __init__(self, content, on_close, **kw):
    super().__init__(content, **kw)
    self.on_close = on_close

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      await self.body_iterator.aclose()
      self.on_close()


class _Call:
  """One HTTP generation request in flight: its choices, engine requests and timings."""

  def __init__(self, server, req: protocol.GenRequest, role: str, prompts_ids: list[list[int]]):
    self.server, self.req, self.role = server, req, role
    self.worker = server.versions[role]
    self.prompts_ids = prompts_ids
    self.start = time.perf_counter()
    self.sink: asyncio.Queue = asyncio.Queue()
    self.choices, self.gens = [], {}
    self.first: dict[int, float] = {}
    self.end: dict[int, float] = {}
    self.done = False    # finish() has run: metrics and monitors count a request once
    self.refused = False  # the engine refused a choice: the client's error, not the model's
    for i, ids in enumerate(prompts_ids):
      for j, params in enumerate(req.params):
        choice = fmt.Choice(i * req.n + j, self.worker.tokenizer, req.logprobs)
        gen = self.worker.submit(ids, params, self.sink)
        self.choices.append(choice)
        self.gens[gen] = choice
    self.open = set(self.gens)

  @property
  def prompt_tokens(self) -> int:
    return sum(len(ids) for ids in self.prompts_ids)

  async def next(self):
    """(choice, token) of the next token of any choice."""
    gen, token = await self.sink.get()
    choice = self.gens[gen]
    now = time.perf_counter()
    self.first.setdefault(choice.index, now)
    choice.add(token)
    if token.finish_reason != "error":
      self.server.metrics.generated(self.role, 1)
    if token.finish_reason is not None:
      self.open.discard(gen)
      self.end[choice.index] = now
      if token.finish_reason == "error":
        choice.error = gen.error or "generation failed"
        if gen.invalid:
          self.refused = True
          raise bad(choice.error)  # the engine refused it: the client's request is at fault
    return choice, token

  def cancel(self) -> None:
    for gen in self.open:
      self.worker.cancel(gen)
    self.open = set()

  @property
  def failed(self) -> str | None:
    return next((c.error for c in self.choices if c.error), None)

  def finish(self, disconnected: bool = False) -> None:
    """Metrics and monitors, once, however the request ended."""
    s, m, role = self.server, self.server.metrics, self.role
    m.generations.labels(role).inc()
    m.prompt_tokens.labels(role).inc(self.prompt_tokens)
    if disconnected:
      m.disconnects.labels(role).inc()
      return
    if self.refused:
      return  # counted as a client error (400) by the HTTP layer
    if self.failed:
      m.errors.labels("generation", role).inc()
      s.release.record(role, error=True)
      return
    now = time.perf_counter()
    tpots = []
    for c in self.choices:
      first = self.first.get(c.index)
      if first is not None:
        m.ttft.labels(role).observe(first - self.start)
        end = self.end.get(c.index, now)
        if c.completion_tokens > 1:
          tpots.append((end - first) / (c.completion_tokens - 1))
          m.tpot.labels(role).observe(tpots[-1])
    m.latency.labels(role).observe(now - self.start)
    # Time per token after the first: a short answer is not slow because of its prompt's TTFT.
    s.release.record(role, error=False, tpot=max(tpots) if tpots else None)
    s.score(role, self.req, self.choices[0].text)


class Server:
  """Everything a request needs: versions, release, metrics and limits (see infer/server/launch.py)."""

  def __init__(self, versions, release, metrics, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_concurrent: int = 256,
               max_tokens_limit: int = 4096, refusal=None, judge=None, seed: int = 0):
    self.versions, self.release, self.metrics = versions, release, metrics
    self.model_name, self.api_key = model_name, api_key
    self.max_body_bytes, self.max_concurrent = max_body_bytes, max_concurrent
    self.max_tokens_limit = max_tokens_limit
    self.refusal, self.judge = refusal, judge
    self.in_flight = 0
    self._rng = random.Random(seed)  # which responses the monitors sample
    self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scorer")
    self._backlog = threading.BoundedSemaphore(256)  # responses waiting to be scored
    release.on_change = self._on_release_change

  def _on_release_change(self, state: str) -> None:
    if state == "rolled_back":
      self.metrics.rollbacks.inc()

  # ---- requests ----

  def _encode(self, worker, prompt, kind: str) -> list[int]:
    tok = worker.tokenizer
    if kind == "chat":
      if not tok.chat_template:
        raise bad("this model has no chat template: use /v1/completions", "messages")
      try:
        text = tok.apply_chat_template(prompt)
      except Exception as e:  # noqa: BLE001 -- a template may raise anything on odd input
        raise bad(f"the chat template failed on these messages: {str(e)[:200]}",
                  "messages") from None
      return tok.encode(text, add_bos=False)
    if isinstance(prompt, str):
      return tok.encode(prompt)
    vocab = worker.engine.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
      raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
    return list(prompt)

  def _fit(self, req: protocol.GenRequest, prompts_ids, worker) -> None:
    """400 when a prompt or prompt + max_tokens exceeds the context; sets chat's default."""
    limit = worker.max_seq_len
    longest = max(len(ids) for ids in prompts_ids)
    if longest == 0:
      raise bad("the prompt is empty after tokenization", "prompt")
    if longest >= limit:
      raise bad(f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {longest} tokens (the context must also hold one new token).",
                "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
    if req.max_tokens is None:  # the context's rest, as far as the KV pool can hold it
      pool = worker.engine.blocks.num_blocks * worker.engine.block_size
      protocol.with_max_tokens(req, max(1, min(limit - longest, pool - longest + 1,
                                               self.max_tokens_limit)))
    elif longest + req.max_tokens > limit:
      raise bad(f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {longest + req.max_tokens} tokens ({longest} in the prompt, "
                f"{req.max_tokens} for the completion).", "max_tokens",
                "context_length_exceeded")

  async def handle(self, request: Request, kind: str) -> Response:
    body = await app_lib.read_json(request, self.max_body_bytes)
    req = protocol.parse(body, kind, max_tokens_limit=self.max_tokens_limit)
    if req.model != self.model_name:
      raise ApiError(404, f"The model {req.model[:100]!r} does not exist (this server serves "
                     f"{self.model_name!r})", param="model", code="model_not_found")
    if self.in_flight >= self.max_concurrent:
      self.metrics.rejected.inc()
      raise ApiError(429, f"{self.in_flight} requests in flight, the limit is "
                     f"{self.max_concurrent}: retry later", type="rate_limit_error",
                     code="too_many_requests", headers={"Retry-After": "1"})
    role = self.release.route(req.user)
    worker = self.versions[role]
    prompts_ids = [self._encode(worker, p, kind) for p in req.prompts]
    self._fit(req, prompts_ids, worker)
    self.in_flight += 1
    self.metrics.in_flight.set(self.in_flight)
    call = _Call(self, req, role, prompts_ids)
    rid = fmt.new_id(kind)
    fingerprint = f"meshlm-{role}"
    headers = {"x-meshlm-version": role}
    try:
      if not req.stream:
        return await self._collect(request, call, rid, fingerprint, headers)
      first = await call.next()  # a request the engine refuses still gets a 4xx status
      if call.failed:
        raise ApiError(500, f"generation failed: {call.failed}", type="server_error",
                       headers=headers)
    except BaseException:
      self._done(call, disconnected=False)
      raise
    return _Stream(self._events(call, first, rid, fingerprint),
                   lambda: self._done(call, disconnected=True), headers=headers,
                   media_type="text/event-stream")

  def _done(self, call: _Call, disconnected: bool) -> None:
    if call.done:
      return
    call.done = True
    call.cancel()
    self.in_flight -= 1
    self.metrics.in_flight.set(self.in_flight)
    call.finish(disconnected)

  async def _collect(self, request, call: _Call, rid, fingerprint, headers) -> Response:
    disconnected = False
    checked = time.monotonic()
    try:
      while call.open:
        try:
          await asyncio.wait_for(call.next(), timeout=0.5)
        except asyncio.TimeoutError:
          pass
        if time.monotonic() - checked >= 0.5:  # however fast tokens come
          checked = time.monotonic()
          if await request.is_disconnected():  # nobody will read the answer: stop computing
            disconnected = True
            return Response(status_code=499)
    finally:
      self._done(call, disconnected)
    if call.failed:
      raise ApiError(500, f"generation failed: {call.failed}", type="server_error",
                     headers=headers)
    body = fmt.response(call.req.kind, rid, self.model_name, fingerprint, call.choices,
                        call.prompt_tokens)
    return app_lib.json_response(body, headers=headers)

  async def _events(self, call: _Call, first, rid, fingerprint):
    writer = fmt.ChunkWriter(call.req.kind, rid, self.model_name, fingerprint)
    complete = False
    try:
      if call.req.kind == "chat":
        for choice in call.choices:
          yield writer.role(choice)
      item = first
      while True:
        chunk = writer.delta(*item) if not call.failed else None
        if chunk is not None:
          yield chunk
        if not call.open or call.failed:
          break
        try:
          item = await call.next()
        except ApiError as e:  # a later choice refused after the 200 went out
          yield writer.error(e.message, "invalid_request_error", 400)
          break
      if call.failed and not call.refused:
        yield writer.error(f"generation failed: {call.failed}")
      elif call.req.include_usage:
        yield writer.usage(call.prompt_tokens, call.choices)
      yield writer.done()
      complete = True
    finally:
      self._done(call, disconnected=not complete)

  # ---- monitors ----

  def score(self, role: str, req: protocol.GenRequest, text: str) -> None:
    """Samples a finished response for the refusal (and judge) monitors, off the event loop."""
    cfg = self.release.config
    if self.refusal is not None and self._rng.random() < cfg.refusal_sample_rate:
      self._submit(role, "refusal", self.refusal, text)
    prompt = _user_text(req)
    if self.judge is not None and prompt and self._rng.random() < cfg.judge_sample_rate:
      self._submit(role, "judge", lambda t: self.judge(prompt, t), text)

  def _submit(self, role, kind, fn, text) -> None:
    if not self._backlog.acquire(blocking=False):
      return  # the scorers are behind: late samples would land in the wrong window
    self._scorer.submit(self._score, role, kind, fn, text)

  def _score(self, role, kind, fn, text) -> None:
    try:
      value = fn(text)
    except Exception:  # noqa: BLE001 -- a scorer failing must not fail requests
      log.exception("the %s monitor failed", kind)
      return
    finally:
      self._backlog.release()
    self.release.record(role, **{kind: value})

  # ---- release ----

  def rollback(self, reason: str) -> None:
    self.release.rollback(reason)

  async def promote(self, reason: str) -> None:
    if "canary" not in self.versions.roles:
      raise ValueError("nothing to promote: no canary is served")
    self.release.promote(reason)
    old = self.versions.promote()
    # The old stable finishes what it is serving, then stops (its thread, not the loop's).
    asyncio.get_running_loop().run_in_executor(None, _retire, old)

  def close(self) -> None:
    self._scorer.shutdown(wait=False, cancel_futures=True)
    self.versions.stop()


def _user_text(req: protocol.GenRequest) -> str:
  """What the reward model reads as the user's turn: chat's last user message, or a text
  prompt ("" for token ids: nothing to judge)."""
  first = req.prompts[0]
  if req.kind == "chat":
    return next((m["content"] for m in reversed(first) if m["role"] == "user"), "")
  return first if isinstance(first, str) else ""


def _retire(worker) -> None:
  deadline = time.time() + 600
  while worker.busy and time.time() < deadline:
    time.sleep(0.1)
  worker.stop()
