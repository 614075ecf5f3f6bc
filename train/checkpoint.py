"""Asynchronous Orbax checkpoints of the train state, the data iterator's position and the config.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a half-written checkpoint is never listed. A complete but damaged
one (truncated or missing file, bad metadata) fails to restore: `restore` then
logs which one and why and falls back to the next older checkpoint.
"""

import concurrent.futures
import logging
import os
import time

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
    """Newest restorable checkpoint (or `step`) into the shardings of `state_template`.

    The template's shardings may differ from those the checkpoint was written
    with (another mesh or device count): Orbax reshards on read. The data
    iterator is restored in place. Returns (state, step).
    """
    steps = sorted(self.manager.all_steps(), reverse=True) if step is None else [step]
    if not steps:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_template)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    failures = []
    for candidate in steps:
      try:
        restored = self.manager.restore(candidate, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
            data=grain.checkpoint.CheckpointRestore(data_iter)))
      except Exception as e:  # any damage: truncated, missing or inconsistent files
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        logging.error("checkpoint %d in %s is unreadable (%s); trying an older one",
                      candidate, self.directory, reason)
        print(f"meshlm: checkpoint {candidate} is unreadable ({reason}); "
              "falling back to an older one", flush=True)
        failures.append((candidate, reason))
        continue
      if failures:
        self._quarantine([s for s, _ in failures])
      return restored["state"], candidate
    raise ValueError(f"no readable checkpoint in {self.directory}: " +
                     "; ".join(f"step {s}: {r}" for s, r in failures))

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


def restore_params(workdir: str, params_template, step: int | None = None):
  """Just the parameters of the newest (or given) checkpoint in a training workdir."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints directory at {directory}")
  handlers = {"state": ocp.PyTreeCheckpointHandler()}
  with ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found in {directory}")
    # Only `params`: a partial tree of the saved state, without optimizer moments.
    abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params_template)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        abstract, restore_args=restore_args, partial_restore=True)))
    return restored["state"]["params"], step
