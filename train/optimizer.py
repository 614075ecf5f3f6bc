"""AdamW with linear warmup and cosine decay, behind global-norm clipping."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from ml_collections import ConfigDict


def learning_rate_schedule(opt: ConfigDict, total_steps: int) -> optax.Schedule:
  warmup = min(int(opt.warmup_steps), total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=opt.lr * opt.min_lr_ratio)


def _decay_mask(params):
  """Weight decay on matrices only: norm scales (one logical axis besides `layers`) are exempt."""

  def is_matrix(v):
    if not isinstance(v, nnx.Variable):  # a plain array (LoRA adapters): decay matrices
      return jnp.ndim(v) >= 2
    names = [n for n in (v.get_metadata().get("out_sharding") or ()) if n != "layers"]
    return v.replace(len(names) >= 2)

  return jax.tree.map(is_matrix, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def make_optimizer(opt: ConfigDict, total_steps: int) -> tuple[optax.GradientTransformation,
                                                                 optax.Schedule]:
  """Returns the optimizer and its schedule (the schedule is logged as `lr`)."""
  if opt.lr <= 0:
    raise ValueError(f"optimizer.lr must be positive, got {opt.lr}")
  schedule = learning_rate_schedule(opt, total_steps)
  tx = optax.chain(
      optax.clip_by_global_norm(opt.clip_norm),
      optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                  mask=_decay_mask),
  )
  return tx, schedule
