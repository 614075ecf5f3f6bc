"""What a training run optimises: the piece of the loop that differs between pretraining,
SFT, reward models, DPO and distillation.

train/loop.py owns everything else (mesh, checkpoints, resume, preemption, anomalies,
watchdog, metrics); a Task supplies

  datasets(plan)                 {"train": grain dataset (endless), "validation": one pass}
  make_optimizer(config)         (tx, schedule): the optimizer the loop steps with (on-policy
                                 RL stretches the schedule over several updates a step)
  init_state(plan, tx, mesh, layout)
                                 (state, shardings, frozen, frozen_shardings): `state` is the
                                 train state of train/state.py over the *trainable* params;
                                 `frozen` is a pytree the step reads but never updates (a
                                 reference model, a teacher, a LoRA's base weights), or None
  step_fn(...)                   jitted step(state, batch, frozen) -> (state, metrics)
  evaluate(params, frozen, batches, batch_sharding) -> {"val_...": float}
  prepare(state, frozen, batch, step) (optional) -> batch: work on each batch before the
                                 step, with the current state (PPO/GRPO rollouts): this
                                 process's rows, and fields already global (to_global);
                                 deterministic in (state, batch, step) so resume is exact
  finish(state, frozen, step, plan) (optional): after the last step (a LoRA run's export)
  eval_model(state, frozen) (optional): the generating model at `state`, for an evaluation
                                 gate (train/gate.py)

LMTask is next-token prediction over train/data.py's packed rows (also the SFT loss: rows
carry a loss_mask). align/tasks.py holds the alignment tasks.
"""

import functools
import itertools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import parallel
from train import global_data
from train import step as step_lib
from train.optimizer import make_optimizer
from train.state import create_train_state


def field_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
  """A batch field of rank `ndim`: the first ndim entries of the batch spec (a [B] field
  shards like the rows of a [B, T] one)."""
  return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[:ndim]))


def to_global(batch, sharding: NamedSharding):
  """Process-local numpy rows -> global arrays laid out by field_sharding. A field that is
  already a global array (a task's `prepare` computed it on the mesh) is kept, or resharded
  on the devices when its layout differs: never gathered through the host."""
  def one(v):
    if isinstance(v, jax.Array):
      target = field_sharding(sharding, v.ndim)
      return v if v.sharding == target else jax.device_put(v, target)
    v = np.asarray(v)
    return jax.make_array_from_process_local_data(field_sharding(sharding, v.ndim), v)
  return {k: one(v) for k, v in batch.items()}


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))


class LMTask:
  """Next-token cross-entropy over packed rows, weighting every counted token equally."""

  name = "lm"

  def __init__(self, config):
    self.config = config
    self.tokens_per_step = config.batch_size * config.seq_len

  def datasets(self, plan) -> dict:
    c = self.config
    return {split: global_data.make_global_dataset(
        c.data, plan.tokenizer, seq_len=c.seq_len, global_batch_size=c.batch_size,
        split=split, seed=c.seed, num_shards=c.data.num_shards, arch=plan.model_cfg.arch,
        vocab_size=plan.model_cfg.vocab_size) for split in ("train", "validation")}

  def make_optimizer(self, config):
    """(tx, schedule): AdamW with warmup and cosine decay over config.steps."""
    return make_optimizer(config.optimizer, config.steps)

  def init_state(self, plan, tx, mesh, layout):
    self.graphdef, state, shardings = create_train_state(
        plan.model_cfg, tx, mesh, self.config.seed, layout, params=plan.init_params)
    self._eval = None
    self._param_shardings = shardings["params"]
    return state, shardings, None, None

  def step_fn(self, tx, schedule, shardings, frozen_shardings, batch_sh, inject_nan=False):
    step = step_lib.jit_train_step(self.graphdef, tx, schedule, shardings, batch_sh,
                                   self.config.grad_accum, inject_nan=inject_nan)
    return lambda state, batch, frozen: step(state, batch)

  def eval_model(self, state, frozen):
    """The model at `state`, for an evaluation gate (train/gate.py)."""
    return nnx.merge(self.graphdef, state["params"])

  def evaluate(self, params, frozen, batches, batch_sh) -> dict:
    """Mean per-token loss over `batches`."""
    if self._eval is None:
      self._eval = step_lib.jit_eval_step(self.graphdef, self._param_shardings, batch_sh)
    total, count = 0.0, 0.0
    for batch in batches:
      loss_sum, n = self._eval(params, to_global(batch, batch_sh))
      total, count = total + float(loss_sum), count + float(n)
    return {"val_loss": total / max(count, 1.0)}


def first(ds, n: int):
  """The first n batches of a validation dataset."""
  return itertools.islice(iter(ds), n)


def jit_objective_step(loss_fn, tx, schedule, shardings, frozen_shardings, batch_sh,
                       grad_accum: int = 1, inject_nan: bool = False, weight_fn=None,
                       moe_cfg=None):
  """step(state, batch, frozen) around `loss_fn(params, frozen, batch) -> (loss, metrics)`;
  the state is donated, `frozen` is read only. `moe_cfg`: the MoE policy's config, whose
  router losses the step applies (train/step.py: ROUTER_STATS)."""
  step = functools.partial(step_lib.objective_step, loss_fn=loss_fn, tx=tx, schedule=schedule,
                           grad_accum=grad_accum, inject_nan=inject_nan, weight_fn=weight_fn,
                           moe_cfg=moe_cfg)
  return jax.jit(step, in_shardings=(shardings, batch_sh, frozen_shardings),
                 out_shardings=(shardings, None), donate_argnums=0)
