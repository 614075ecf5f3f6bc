"""Asynchronous Orbax checkpoints of the train state, the data iterator's position and the
config, and the one reader every command restores them with.

Orbax writes each checkpoint into a temporary directory, renames it when complete
and writes its commit markers (COMMIT_MARKERS) last: a step without them is an
interrupted save and is never loaded (`committed_steps`). A committed but damaged
one (truncated or missing file, bad metadata) fails to restore: `restore_newest`
then says which, why, and which older step it uses instead, in one line. Training
moves such a step aside (it is its own run); a command that only reads a run
(`restore_params`: generate, serve, eval, quantize, ...) changes nothing in it.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sys
import time
from typing import Callable

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints under WORKDIR/checkpoints; the loop decides when to save."""

  def __init__(self, workdir: str, keep: int, async_save: bool = True, keep_every: int = 0,
               compress: bool = False, idle_writer: bool = False):
    """Keeps the newest `keep` checkpoints, plus every step divisible by `keep_every` (if > 0).

    `compress` zstd-compresses the arrays. It is off by default: on float
    weights and AdamW moments it saves ~10% of the bytes, and on a
    2-core CPU host, where the write shares cores with the training step, the
    async overhead was 15.1% of a step compressed against 12.1% uncompressed
    (benchmarks/checkpoint.py, seven paired runs; docs/notes/checkpoint_overhead.md).

    `idle_writer` starts each save from a helper thread under Linux's
    SCHED_IDLE policy, so the threads Orbax and TensorStore start for the
    background write inherit it, and the pool workers are demoted too: the
    write then runs only on cycles the training step leaves free.
    """
    if keep <= 0 or keep_every < 0:
      raise ValueError(f"keep_checkpoints must be positive and keep_checkpoint_every >= 0, "
                       f"got {keep} and {keep_every}")
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every or None,
                                           enable_async_checkpointing=async_save,
                                           create=True)
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=compress),
                "data": grain.checkpoint.CheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._saver = None
    if idle_writer and not hasattr(os, "SCHED_IDLE"):
      logging.warning("checkpoint_idle_writer needs Linux's SCHED_IDLE; saving at normal priority")
    elif idle_writer and async_save:
      self._saver = concurrent.futures.ThreadPoolExecutor(
          1, thread_name_prefix="meshlm-ckpt", initializer=_idle_policy)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iter, config: dict | None = None,
           force: bool = False) -> bool:
    """Starts an asynchronous save: the state is copied to host memory before this returns,
    and written in the background. Returns whether a save was started."""
    items = dict(state=ocp.args.PyTreeSave(state),
                 data=grain.checkpoint.CheckpointSave(data_iter))
    if config is not None:
      items["config"] = ocp.args.JsonSave(config)
    save = lambda: self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    if self._saver is None:
      return save()
    _demote_pool_workers()
    # Blocks until the snapshot is taken: the next step may donate the state's buffers.
    return self._saver.submit(save).result()

  def restore(self, state_template, data_iter, step: int | None = None):
    """Newest restorable committed checkpoint (or `step`) into the shardings of
    `state_template` (`restore_newest`).

    The template's shardings may differ from those the checkpoint was written
    with (another mesh or device count): Orbax reshards on read. The data
    iterator is restored in place. Returns (state, step).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_template)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    restored, step, failures = restore_newest(
        self.directory, lambda s: self.manager.restore(s, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
            data=grain.checkpoint.CheckpointRestore(data_iter))), step)
    if failures:
      self._quarantine([s for s, _ in failures])
    return restored["state"], step

  def _quarantine(self, steps):
    """Moves unreadable checkpoints to checkpoints.corrupt/ so their steps can be saved again."""
    if jax.process_index() == 0:
      aside = self.directory + ".corrupt"
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target = os.path.join(aside, f"{step}-{int(time.time())}")
        os.replace(os.path.join(self.directory, str(step)), target)
        print(f"meshlm: moved unreadable checkpoint {step} to {target}", flush=True)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("meshlm_checkpoint_quarantine")
    self.manager.reload()

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
    if self._saver is not None:
      self._saver.shutdown()


def _idle_policy():
  try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread only
  except OSError as e:  # e.g. a sandbox that forbids it: the save itself must still happen
    logging.warning("checkpoint_idle_writer: SCHED_IDLE refused (%s); saving at normal "
                    "priority", e)


def _demote_pool_workers():
  """TensorStore's pool workers outlive a save and may have been started by a normal thread."""
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        if f.read().startswith("ts_pool"):
          os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # the thread has exited, or the policy is refused (logged once, above)
      pass


COMMIT_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")  # Orbax writes them last


def say(message: str) -> None:
  """One line on stderr, where a command's output (a completion, JSON) does not carry it."""
  print(f"meshlm: {message}", file=sys.stderr, flush=True)


class _QuietLoop(asyncio.SelectorEventLoop):
  """Drops callbacks scheduled after the loop closed. When one array of a restore fails, Orbax
  closes its loop while TensorStore still reads the others; each late read's callback would
  print a "RuntimeError: Event loop is closed" traceback."""

  def call_soon_threadsafe(self, callback, *args, context=None):
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():
        return None
      raise


class _QuietPolicy(asyncio.DefaultEventLoopPolicy):
  _loop_factory = _QuietLoop


@contextlib.contextmanager
def _quiet_loops():
  """Event loops created inside (Orbax's, for a restore) are _QuietLoops."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_QuietPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def _scan(directory: str) -> tuple[list[int], list[tuple[int, list[str]]]]:
  """(committed steps, [(uncommitted step, its missing markers)]), newest first."""
  if not os.path.isdir(directory):
    return [], []
  committed, uncommitted = [], []
  for step in sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True):
    missing = [m for m in COMMIT_MARKERS if not os.path.isfile(os.path.join(directory, str(step),
                                                                            m))]
    if missing:
      uncommitted.append((step, missing))
    else:
      committed.append(step)
  return committed, uncommitted


def committed_steps(directory: str) -> list[int]:
  """The steps under `directory` whose saves completed (every commit marker present), newest
  first."""
  return _scan(directory)[0]


def failure_reason(e: BaseException) -> str:
  """An exception as one short line: its type and the first line of its message."""
  text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def restore_newest(directory: str, restore: Callable[[int], object],
                   step: int | None = None) -> tuple[object, int, list[tuple[int, str]]]:
  """(restore(s), s, failures) for the newest committed step s that restores (or `step`,
  which must be committed); each uncommitted step is named and skipped; failures: the newer
  steps that did not restore, with their reasons, each said as "checkpoint step 600
  unreadable (reason); using step 400". FileNotFoundError
  where no step is committed, ValueError where none restores."""
  steps, uncommitted = _scan(directory)
  for bad, missing in uncommitted:
    say(f"checkpoint step {bad} was never committed (no {' or '.join(missing)}: an "
        "interrupted save); skipped")
  if step is not None:
    if step not in steps:
      raise FileNotFoundError(f"no committed checkpoint of step {step} in {directory} "
                              f"(committed: {sorted(steps) or 'none'})")
    steps = [step]
  if not steps:
    raise FileNotFoundError(f"no committed checkpoint in {directory}")
  failures = []
  for candidate in steps:
    try:
      with _quiet_loops():
        restored = restore(candidate)
    except Exception as e:  # any damage: truncated, missing or inconsistent files
      failures.append((candidate, failure_reason(e)))
      continue
    for bad, reason in failures:
      say(f"checkpoint step {bad} unreadable ({reason}); using step {candidate}")
    return restored, candidate, failures
  raise ValueError(f"no readable checkpoint in {directory}: " +
                   "; ".join(f"step {s}: {r}" for s, r in failures))


def restore_params(workdir: str, params_template, step: int | None = None):
  """Just the parameters of the newest readable (or given) checkpoint in a training workdir
  (`restore_newest`), read without changing anything in it."""
  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints directory at {directory}")
  handlers = {"state": ocp.PyTreeCheckpointHandler()}
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  # Only `params`: a partial tree of the saved state, without optimizer moments.
  abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params_template)}
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  args = ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args,
                                                         partial_restore=True))
  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)  # Orbax warns that a read-only manager is read-only
  try:
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
  finally:
    absl_log.setLevel(level)
  with manager:
    restored, step, _ = restore_newest(directory, lambda s: manager.restore(s, args=args), step)
  return restored["state"]["params"], step
