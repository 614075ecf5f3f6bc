"""Background monitors that turn silent failures into prompt exits a scheduler can act on.

`Watchdog` ends the process with exit_codes.HUNG when a training step runs far longer
than recent steps did, after dumping every thread's stack. `PeerMonitor` ends it with
exit_codes.PEER_LOST when another process of a multi-process run stops answering.
Both work from daemon threads, so they fire even while the main thread is blocked
inside XLA (a collective waiting for a dead peer, a stuck device, a hung filesystem).
"""

import collections
import contextlib
import faulthandler
import io
import os
import statistics
import sys
import threading
import time
import traceback
from typing import IO

from train import exit_codes

_CLOSED = "closed"  # heartbeat value of a process that finished normally: not a loss
_generation = 0  # numbers the PeerMonitors of a process, so a second one gets fresh keys


class _Log:
  """Writes to a log file or stream and to stderr, flushing each time: the process may
  end with os._exit right after, which skips Python's buffers."""

  def __init__(self, log: str | IO | None):
    self._own = isinstance(log, (str, os.PathLike))
    self.stream = open(log, "a", encoding="utf-8") if self._own else log

  def _targets(self):
    return [sys.stderr] if self.stream in (None, sys.stderr) else [self.stream, sys.stderr]

  def write(self, message: str, stacks: bool = False) -> None:
    for s in self._targets():
      try:
        s.write(message.rstrip("\n") + "\n")
        s.flush()
        if stacks:
          _dump_stacks(s)
      except (OSError, ValueError):  # a closed or broken stream must not stop the exit
        pass

  def close(self) -> None:
    if self._own:
      self.stream.close()


def _dump_stacks(stream: IO) -> None:
  """All threads' stacks: faulthandler where the stream has a file descriptor (it also
  works when Python state is damaged), else Python's own formatting."""
  try:
    faulthandler.dump_traceback(file=stream, all_threads=True)
  except (AttributeError, ValueError, io.UnsupportedOperation):
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()  # noqa: SLF001 stdlib's only way to every thread's frame
    for ident, frame in frames.items():
      stream.write(f"\nThread {ident:#x} ({names.get(ident, '?')}):\n")
      stream.write("".join(traceback.format_stack(frame)))
  stream.flush()


class Watchdog:
  """Exits with HUNG when the current step outlasts max(min_seconds, factor x median step).

  The loop calls step_started(step) before a step and step_finished(step, seconds)
  after it. The first finished step (compilation) never enters the median, and
  nothing is enforced until `warmup` steps have finished. Time spent inside
  `paused()` (evaluation, a synchronous checkpoint) does not count.
  """

  def __init__(self, factor: float = 10.0, min_seconds: float = 300.0,
               log: str | IO | None = None, warmup: int = 2, window: int = 50,
               max_interval: float = 1.0):
    if factor <= 1 or min_seconds <= 0 or warmup < 2 or window < 1:
      raise ValueError(f"Watchdog needs factor > 1, min_seconds > 0, warmup >= 2, window >= 1; "
                       f"got factor={factor}, min_seconds={min_seconds}, warmup={warmup}, "
                       f"window={window}")
    self.factor, self.min_seconds, self.warmup = float(factor), float(min_seconds), warmup
    self._max_interval = max_interval
    self._log = _Log(log)
    self._times = collections.deque(maxlen=window)
    self._finished = 0
    self._step = None  # the running step, None between steps
    self._started = 0.0
    self._paused_for = 0.0  # paused seconds within the running step
    self._pause_depth, self._pause_began = 0, 0.0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="meshlm-watchdog", daemon=True)
    self._thread.start()

  def step_started(self, step: int) -> None:
    with self._lock:
      self._step, self._started, self._paused_for = step, time.monotonic(), 0.0
      if self._pause_depth:
        self._pause_began = self._started

  def step_finished(self, step: int, seconds: float | None = None) -> None:
    """`seconds` defaults to the unpaused time since step_started."""
    with self._lock:
      if seconds is None:
        seconds = self._elapsed(time.monotonic())
      if self._finished > 0:  # the first step compiles: it would inflate the median
        self._times.append(float(seconds))
      self._finished += 1
      self._step = None

  def pause(self) -> None:
    with self._lock:
      if self._pause_depth == 0:
        self._pause_began = time.monotonic()
      self._pause_depth += 1

  def resume(self) -> None:
    with self._lock:
      if self._pause_depth == 0:
        raise RuntimeError("Watchdog.resume() without pause()")
      self._pause_depth -= 1
      if self._pause_depth == 0:
        self._paused_for += time.monotonic() - self._pause_began

  @contextlib.contextmanager
  def paused(self):
    """Excludes a known-long operation (evaluation, synchronous save) from the step's time."""
    self.pause()
    try:
      yield
    finally:
      self.resume()

  def limit(self) -> float | None:
    """Seconds the current step may run, or None before warm-up."""
    with self._lock:
      return self._limit()

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._thread.join()
    self._log.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # Called with the lock held.
  def _limit(self) -> float | None:
    if self._finished < self.warmup or not self._times:
      return None
    return max(self.min_seconds, self.factor * statistics.median(self._times))

  def _elapsed(self, now: float) -> float:
    paused = self._paused_for + (now - self._pause_began if self._pause_depth else 0.0)
    return now - self._started - paused

  def _run(self) -> None:
    interval = self._max_interval
    while not self._stop.wait(interval):
      with self._lock:
        limit = self._limit()
        # Poll often enough to overshoot the limit by at most ~10%.
        interval = max(0.01, min(self._max_interval, limit / 10)) if limit else self._max_interval
        if limit is None or self._step is None or self._pause_depth:
          continue
        elapsed = self._elapsed(time.monotonic())
        if elapsed <= limit:
          continue
        step, median = self._step, statistics.median(self._times)
      self._log.write(
          f"meshlm watchdog: step {step} has run {elapsed:.1f} s, over its limit of "
          f"{limit:.1f} s = max(min_seconds {self.min_seconds:g}, {self.factor:g} x median step "
          f"{median:.3f} s over the last {len(self._times)}); the process looks hung. "
          f"Stacks of all threads follow; exiting with status {exit_codes.HUNG}.", stacks=True)
      os._exit(exit_codes.HUNG)


class PeerMonitor:
  """Exits with PEER_LOST when another process of a multi-process run stops answering.

  Every process writes a heartbeat counter into the coordination service's key-value
  store every `poll_s`. Process 0 (which hosts the service) watches all counters; one
  that has not changed for `timeout_s` marks its process lost: process 0 publishes
  that, waits briefly so the others can read it, and exits; the others exit when
  they read it. The others watch process 0's counter and their own RPCs the same way.
  Start it right after jax.distributed.initialize in every process (or allow for the
  spread with start_grace_s). A no-op in single-process runs. close() tells the peers
  this process finished normally.
  """

  def __init__(self, timeout_s: float = 30.0, poll_s: float = 1.0, log: str | IO | None = None,
               *, start_grace_s: float = 0.0, client=None, process_id: int | None = None,
               num_processes: int | None = None):
    if num_processes is None or process_id is None:
      import jax
      num_processes = jax.process_count() if num_processes is None else num_processes
      process_id = jax.process_index() if process_id is None else process_id
    self.active = num_processes > 1
    self._closed = False
    if not self.active:
      return
    if timeout_s < 3 * poll_s:
      raise ValueError(f"PeerMonitor needs timeout_s >= 3 * poll_s, got timeout_s={timeout_s}, "
                       f"poll_s={poll_s}")
    if client is None:
      from jax._src import distributed  # noqa: PLC2701 no public jax API for the KV client
      client = distributed.global_state.client
      if client is None:
        raise RuntimeError("PeerMonitor: jax.distributed is not initialized")
    global _generation
    _generation += 1
    self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
    self.process_id, self.num_processes, self._client = process_id, num_processes, client
    self._prefix = f"meshlm/peer_monitor/{_generation}"
    self._log = _Log(log)
    now = time.monotonic()
    watched = range(1, num_processes) if process_id == 0 else [0]
    # A peer not heard from yet gets timeout_s (+ start_grace_s, for monitors started at
    # different times) from now: jax.distributed.initialize() returned, so all are up.
    first = now + start_grace_s
    self._seen = {p: (None, first) for p in watched}  # process -> (last value, when it changed)
    self._last_ok, self._last_error, self._reported = now, None, None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._threads = [threading.Thread(target=f, name=f"meshlm-peer-{n}", daemon=True)
                     for n, f in (("poll", self._poll), ("check", self._check))]
    for t in self._threads:
      t.start()

  def close(self) -> None:
    """Stops monitoring and marks this process finished, so peers don't count it lost.
    Call it only after a normal finish: a process that fails should just exit."""
    if not self.active or self._closed:
      return
    self._closed = True
    self._stop.set()
    for t in self._threads:
      t.join(timeout=2 * self.poll_s + 1)
    # From a thread: a frozen coordination service must not hang a finished run.
    self._set_soon(self._key(self.process_id), _CLOSED, wait=2 * self.poll_s + 1)
    self._log.close()

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    if exc_type is None:
      self.close()

  def _key(self, pid: int) -> str:
    return f"{self._prefix}/hb/{pid}"

  def _poll(self) -> None:
    """Heartbeats and reads; RPCs may block, so the decisions live in _check."""
    beat = 0
    while not self._stop.is_set():
      beat += 1
      try:
        self._client.key_value_set(self._key(self.process_id), str(beat), allow_overwrite=True)
        if self.process_id == 0:
          values = {int(k.rsplit("/", 1)[1]): v
                    for k, v in self._client.key_value_dir_get(f"{self._prefix}/hb/")}
          reported = None
        else:
          values = {}
          try:
            values[0] = self._client.key_value_try_get(self._key(0))
          except Exception as e:
            if "NOT_FOUND" not in str(e):  # process 0 may not have written yet
              raise
          reported = self._client.key_value_dir_get(f"{self._prefix}/lost/")
        now = time.monotonic()
        with self._lock:
          for p, v in values.items():
            if p in self._seen and v != self._seen[p][0]:
              self._seen[p] = (v, now)
          self._last_ok = now
          if reported:
            self._reported = reported[0][1]
      except Exception as e:  # keep trying: _check decides when failures last too long
        with self._lock:
          self._last_error = e
      self._stop.wait(self.poll_s)

  def _check(self) -> None:
    while not self._stop.wait(min(self.poll_s, 1.0)):
      now = time.monotonic()
      with self._lock:
        reported = self._reported
        stale = {p: now - t for p, (v, t) in self._seen.items()
                 if v != _CLOSED and now - t > self.timeout_s}
        silent = now - self._last_ok
        error = self._last_error
      if reported is not None:
        pids, reason = reported.split("|", 1)
        self._lost([int(p) for p in pids.split(",")], f"{reason} (reported by process 0)")
      elif stale:
        self._lost(sorted(stale), f"no heartbeat for {max(stale.values()):.1f} s "
                                  f"(timeout {self.timeout_s:g} s)")
      elif silent > self.timeout_s:
        what = ("the coordination service (process 0) has not answered" if self.process_id else
                "this process's own coordination service has not answered")
        self._lost([0] if self.process_id else [],
                   f"{what} for {silent:.1f} s (timeout {self.timeout_s:g} s); last error: "
                   f"{str(error).splitlines()[0] if error else 'none, calls blocked'}")

  def _lost(self, pids: list[int], reason: str) -> None:
    others = [p for p in pids if p != self.process_id]
    if self.process_id in pids:
      head = f"process 0 lost contact with this process ({self.process_id}): "
    elif others:
      head = (f"lost peer process {others[0]}: " if len(others) == 1 else
              f"lost peer processes {', '.join(map(str, others))}: ")
    else:
      head = "lost the coordination service: "
    self._log.write(f"meshlm peer monitor (process {self.process_id}): {head}{reason}; "
                    f"exiting with status {exit_codes.PEER_LOST}.")
    if self.process_id == 0 and pids:
      # Tell the others before exiting: once process 0 (the coordination service) is
      # gone, JAX aborts them at once with SIGABRT instead of this clear status.
      self._set_soon(f"{self._prefix}/lost/0", f"{','.join(map(str, pids))}|{reason}", wait=0)
      time.sleep(2 * self.poll_s + 0.5)
    os._exit(exit_codes.PEER_LOST)

  def _set_soon(self, key: str, value: str, wait: float) -> None:
    """Sets a key from a daemon thread, waiting at most `wait` seconds: the RPC may block."""
    def set_key():
      try:
        self._client.key_value_set(key, value, allow_overwrite=True)
      except Exception:  # the service may be gone; there is no one left to tell
        pass
    thread = threading.Thread(target=set_key, name="meshlm-peer-set", daemon=True)
    thread.start()
    thread.join(wait)
