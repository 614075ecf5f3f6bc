"""One model version served by a thread that owns its continuous-batching engine.

The HTTP side (asyncio) never touches the engine: it posts requests and
cancellations to the worker's inbox and reads Tokens from an asyncio queue per
request. The worker thread adds what arrived, runs one engine step (JAX releases
the GIL while it computes, so the event loop keeps serving), and hands each new
token to its request's queue with `call_soon_threadsafe`. A cancelled request
(its client went away) is aborted in the engine, which frees its KV blocks at once.
"""

import asyncio
import logging
import queue
import threading
import time

from infer.requests import Token
from infer.sampling import SamplingParams
from infer.serving import PagedEngine

log = logging.getLogger("meshlm.serve")


class Generation:
  """One engine request seen from the event loop: its Tokens arrive on `sink` as (self, token)
  until one has a finish_reason. A refused request gets a single Token with finish_reason
  "error" and `error` set."""

  def __init__(self, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue):
    self.loop, self.sink = loop, sink
    self.rid: int | None = None
    self.error: str | None = None
    self.invalid = False  # the engine refused the request (a client error, not a model error)

  def deliver(self, token: Token) -> None:
    """Hands `token` to `sink` on the event loop; safe from any thread (call_soon_threadsafe)."""
    self.loop.call_soon_threadsafe(self.sink.put_nowait, (self, token))


class EngineWorker:
  """Runs a PagedEngine on its own thread; see the module docstring."""

  def __init__(self, engine: PagedEngine, name: str, *, path: str = "", tokenizer=None):
    self.engine, self.name, self.path = engine, name, path
    self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._live: dict[int, Generation] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
    self.stats = engine.counters()
    self.steps_failed = 0
    self.dead: str | None = None  # why the thread died, if it did

  @property
  def pending(self) -> int:
    """Messages posted that the thread has not picked up yet."""
    return self._inbox.qsize()

  @property
  def max_seq_len(self) -> int:
    return self.engine.max_seq_len

  def start(self) -> "EngineWorker":
    self._thread.start()
    return self

  def stop(self, timeout: float = 10.0) -> None:
    self._stop.set()
    self._inbox.put(("wake", None, None))
    self._thread.join(timeout)

  def submit(self, prompt_ids: list[int], params: SamplingParams,
             sink: asyncio.Queue) -> Generation:
    """Queues a request whose tokens go to `sink`; call from the event loop."""
    gen = Generation(asyncio.get_running_loop(), sink)
    if not self.alive:  # fail fast: no thread will ever answer
      gen.error = self.dead or "the engine is stopped"
      gen.deliver(Token(-1, "", None, "error"))
      return gen
    self._inbox.put(("add", gen, (prompt_ids, params)))
    return gen

  def cancel(self, gen: Generation) -> None:
    """Stops a request that is still running (no-op for a finished one)."""
    self._inbox.put(("abort", gen, None))

  # ---- the worker thread ----

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.dead is None

  @property
  def busy(self) -> bool:
    """Requests still in the engine or on their way to it."""
    return bool(self._live) or self.pending > 0 or self.engine.has_work

  def _run(self) -> None:
    try:
      self._loop()
      reason = "the server is shutting down"
    except BaseException as e:  # noqa: BLE001 -- whatever kills the thread, nobody may hang
      log.exception("engine %s: the worker thread died", self.name)
      self.dead = reason = f"the engine thread died: {type(e).__name__}: {str(e)[:200]}"
    self._fail_all(reason)

  def _fail_all(self, reason: str) -> None:
    """Every live and queued request gets a final error token."""
    gens = list(self._live.values())
    self._live.clear()
    try:
      while True:
        kind, gen, _ = self._inbox.get_nowait()
        if kind == "add":
          gens.append(gen)
    except queue.Empty:
      pass
    for gen in gens:
      gen.error = reason
      try:
        gen.deliver(Token(-1, "", None, "error"))
      except RuntimeError:  # its event loop is closed: nobody is waiting
        pass

  def _loop(self) -> None:
    while not self._stop.is_set():
      try:
        # Idle: sleep until something arrives. Busy: take what is there and step.
        busy = self.engine.has_work
        self._handle(self._inbox.get_nowait() if busy else self._inbox.get())
        while True:
          self._handle(self._inbox.get_nowait())
      except queue.Empty:
        pass
      if self._stop.is_set():
        break
      if self.engine.has_work:
        self._step()
      self.stats = self.engine.counters()

  def _handle(self, message) -> None:
    kind, gen, payload = message
    if kind == "add":
      prompt_ids, params = payload
      try:
        gen.rid = self.engine.add_request(prompt_ids, params)
      except ValueError as e:
        gen.error, gen.invalid = str(e), True
        gen.deliver(Token(-1, "", None, "error"))
        return
      self._live[gen.rid] = gen
    elif kind == "abort" and gen.rid is not None and gen.rid in self._live:
      del self._live[gen.rid]
      self.engine.abort(gen.rid)

  def _step(self) -> None:
    try:
      t0 = time.perf_counter()
      events = self.engine.step()
      log.debug("engine %s: step %.3fs, %d tokens, %s", self.name, time.perf_counter() - t0,
                len(events), self.stats)
    except Exception as e:  # noqa: BLE001 -- a failed step must not kill the server
      self.steps_failed += 1
      log.exception("engine %s: step failed; failing its %d requests", self.name,
                    len(self._live))
      for rid, gen in list(self._live.items()):
        gen.error = f"the engine failed: {type(e).__name__}: {str(e)[:200]}"
        gen.deliver(Token(-1, "", None, "error"))
        self.engine.abort(rid)
      self._live.clear()
      self.engine.reset()  # the failed step may have consumed the donated KV pool
      return
    for rid, token in events:
      gen = self._live.get(rid)
      if gen is None:
        continue
      if token.finish_reason is not None:
        result = self.engine.release(rid)
        del self._live[rid]
        gen.error = result.error
      gen.deliver(token)


class Versions:
  """The served versions by role ("stable", "canary"), each an EngineWorker."""

  def __init__(self, stable: EngineWorker, canary: EngineWorker | None = None):
    self.roles: dict[str, EngineWorker] = {"stable": stable}
    if canary is not None:
      self.roles["canary"] = canary
    self.started = time.time()

  def __getitem__(self, role: str) -> EngineWorker:
    return self.roles[role]

  def promote(self) -> EngineWorker:
    """The canary becomes stable; returns the old stable worker (stop it when it drains)."""
    old = self.roles["stable"]
    self.roles["stable"] = self.roles.pop("canary")
    self.roles["stable"].name = "stable"
    return old

  def stop(self) -> None:
    for worker in self.roles.values():
      worker.stop()
