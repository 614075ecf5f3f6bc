"""Asynchronous Orbax checkpoints of the train state and the data iterator's position."""

import os

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints under WORKDIR/checkpoints; the loop decides when to save."""

  def __init__(self, workdir: str, keep: int, async_save: bool = True):
    if keep <= 0:
      raise ValueError(f"keep_checkpoints must be positive, got {keep}")
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                           enable_async_checkpointing=async_save,
                                           create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iter, force: bool = False) -> bool:
    """Starts an asynchronous save (returns before it is on disk); returns whether it did."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=grain.checkpoint.CheckpointSave(data_iter))
    return self.manager.save(step, args=args, force=force)

  def restore(self, state_template, data_iter, step: int | None = None):
    """Restores into shardings/dtypes of `state_template`; the iterator is restored in place."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_template)
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                      data=grain.checkpoint.CheckpointRestore(data_iter)))
    return restored["state"], step

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


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
