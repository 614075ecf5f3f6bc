"""Two training loops timed in turns, each in a process of its own (benchmarks/train_throughput.py).

    procs = {name: SideProcess(name, build, (name, ...), env) for name in ("a", "b")}
    timed = time_rounds(procs, batches, warmup, rounds)   # {name: (times, cpu, losses)}

`build(stack, *build_args) -> (run_step, report)` runs in the child: `run_step(batch)`
returns the loss as a float (which synchronises), `report(times, cpu, losses)` the JSON
fields; run_step None means the side cannot run, and `report` is then the reason. A
process of its own gives each side the environment it starts with (glibc reads its
tunables only then) and keeps its threads and heap away from the other side's.
"""

import contextlib
import multiprocessing
import os
import time
import traceback

import numpy as np

REPLY_TIMEOUT_S = 3600.0  # a compile plus a block of steps; a child silent longer is wedged


def time_steps(run_step, tokens, warmup):
  """Runs every batch; returns (wall s, process CPU s, loss) per timed step.

  `run_step` must return the loss as a Python float, which also synchronises.
  """
  times, cpu, losses = [], [], []
  for i, batch in enumerate(tokens):
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = run_step(batch)
    if i >= warmup:
      times.append(time.perf_counter() - start)
      cpu.append(time.process_time() - cpu_start)
      losses.append(loss)
  return times, cpu, losses


def _bounds(steps, rounds):
  """Where each round's timed steps start and end: rounds of equal size, give or take one."""
  return np.linspace(0, steps, rounds + 1).astype(int)


def time_rounds(sides, tokens, warmup, rounds):
  """Runs every batch on every side; returns {name: (wall s, process CPU s, loss) per timed step}.

  `sides` maps a name to run(batches, warmup) -> time_steps' lists. The timed steps are
  split into `rounds` blocks and the sides take turns block by block (ABBA order), so a
  drift in the host's speed lands on both sides alike instead of on whichever side
  happened to run later. Each block first repeats its first batch untimed: on this host a
  process's first step after a pause of even half a second, or after other work, ran
  1.6-2.7 s instead of 0.6 (meshlm; torch less), which a loop stepping back to back never
  pays. So each side makes `rounds` more updates than it has timed steps, on the same
  batches.
  """
  out = {name: ([], [], []) for name in sides}
  for run in sides.values():
    run(tokens[:warmup], warmup)
  timed = tokens[warmup:]
  bounds = _bounds(len(timed), rounds)
  names = list(sides)
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      block = timed[bounds[r]:bounds[r + 1]]
      for acc, new in zip(out[name], sides[name](np.concatenate([block[:1], block]), 1)):
        acc.extend(new)
  return out


def round_ratios(meshlm_times, torch_times, steps, rounds):
  """meshlm tokens/s over torch tokens/s within each round (the same stretch of wall time)."""
  bounds = _bounds(steps, rounds)
  return [sum(torch_times[a:b]) / sum(meshlm_times[a:b])
          for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _serve(conn, build, build_args):
  """A side's process: builds it, then runs the batches and reports it is sent."""
  try:
    with contextlib.ExitStack() as stack:
      run_step, report = build(stack, *build_args)
      conn.send(("ok", None if run_step else report))  # report: why the side cannot run
      if run_step is None:
        return
      while (msg := conn.recv()) is not None:
        kind, payload = msg
        conn.send(("ok", time_steps(run_step, *payload) if kind == "steps"
                   else report(*payload)))
  except (EOFError, BrokenPipeError):  # the parent is gone: nobody to tell
    return
  except Exception:  # noqa: BLE001 -- the parent raises it, with this traceback
    conn.send(("error", traceback.format_exc()))


def _setenv(key, value):
  if value is None:
    os.environ.pop(key, None)
  else:
    os.environ[key] = value


@contextlib.contextmanager
def _environ(changes):
  """os.environ with `changes` applied (None removes a variable), restored afterwards."""
  saved = {k: os.environ.get(k) for k in changes}
  try:
    for k, v in changes.items():
      _setenv(k, v)
    yield
  finally:
    for k, v in saved.items():
      _setenv(k, v)


class SideProcess:
  """One side of the comparison in a spawned process, taking orders over a pipe.

  `env` changes the environment the process starts with (None removes a variable).
  """

  def __init__(self, name, build, build_args, env=None):
    ctx = multiprocessing.get_context("spawn")
    self.name, (self.conn, child) = name, ctx.Pipe()
    self.proc = ctx.Process(target=_serve, args=(child, build, build_args), daemon=True)
    with _environ(env or {}):
      self.proc.start()
    child.close()
    self.skipped = self._recv()  # None once built, else the reason it cannot run

  def _recv(self):
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while not self.conn.poll(1.0):
      if not self.proc.is_alive():
        break  # a reply sent just before exiting is still read below
      if time.monotonic() > deadline:
        self.proc.kill()
        raise RuntimeError(f"the {self.name} process sent nothing for {REPLY_TIMEOUT_S:.0f} s")
    try:
      status, payload = self.conn.recv()
    except EOFError:
      self.proc.join(5)
      raise RuntimeError(f"the {self.name} process died (exit code {self.proc.exitcode})")
    if status == "error":
      raise RuntimeError(f"the {self.name} process failed:\n{payload}")
    return payload

  def __call__(self, batches, warmup):
    self.conn.send(("steps", (batches, warmup)))
    return self._recv()

  def report(self, timed):
    self.conn.send(("report", timed))
    return self._recv()

  def close(self):
    try:
      self.conn.send(None)
    except (BrokenPipeError, OSError):
      pass
    self.proc.join(30)
    if self.proc.is_alive():
      self.proc.kill()
