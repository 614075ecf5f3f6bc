"""Scale tuning: a short quantization-aware fine-tune of a quantized model's group scales.

Round-to-nearest, GPTQ and AWQ fix every weight's integer code layer by layer,
each against its own layer's error. This step then trains the float16 group
scales end to end so that the quantized model's next-token distribution matches
the float model's on the calibration text: forward KL at temperature 1
(train.distillation.distill_loss with α = 1), Adam, through
train.step.objective_step, the update every objective shares. The codes stay
fixed, so no straight-through estimator is needed (EfficientQAT's end-to-end
step-size training, Chen et al., 2024). Each scale is trained as
scale·exp(θ), θ starting at 0, so one learning rate suits every layer's
magnitudes and no sign flips; the result is rounded back to float16.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.quant.qarray import QArray
from train.distillation import distill_loss
from train.step import objective_step


def _is_q(x) -> bool:
  return isinstance(x, QArray)


def _scaled(leaves, theta):
  """The model-state leaves with each QArray's scale multiplied by exp(θ)."""
  out = list(leaves)
  for key, t in theta.items():
    q = out[int(key)]
    out[int(key)] = dataclasses.replace(q, scale=q.scale.astype(jnp.float32) * jnp.exp(t))
  return out


def _loss(theta, frozen, batch, *, graphdef, treedef, teacher_graphdef):
  ids_BT = batch["ids"]
  student = nnx.merge(graphdef, jax.tree.unflatten(treedef, _scaled(frozen["leaves"], theta)))
  teacher = nnx.merge(teacher_graphdef, frozen["teacher"])
  student_BTV = student(ids_BT[:, :-1])
  teacher_BTV = teacher(ids_BT[:, :-1])
  mask_BT = jnp.ones(ids_BT[:, 1:].shape, jnp.float32)
  return distill_loss(student_BTV, teacher_BTV, ids_BT[:, 1:], mask_BT, temperature=1.0,
                      alpha=1.0)


def tune_scales(model, teacher, calib_ids_NT, *, epochs: int = 2, batch: int = 8,
                lr: float = 1e-3, seed: int = 0, log=None) -> dict:
  """Trains the scales of `model`'s QArrays in place toward `teacher` (the float model it
  was quantized from) on the calibration ids [N, T]; returns {"kl": [per step], ...}."""
  ids = np.asarray(calib_ids_NT, np.int32)
  if ids.ndim != 2 or ids.shape[1] < 2 or len(ids) < batch:
    raise ValueError(f"scale tuning needs [N, T] calibration ids with N >= batch={batch} and "
                     f"T >= 2, got shape {ids.shape}")
  if not epochs >= 1 or not lr > 0:
    raise ValueError(f"scale tuning: epochs={epochs} must be >= 1 and lr={lr} > 0")
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state, is_leaf=_is_q)
  theta = {str(i): jnp.zeros(q.scale.shape, jnp.float32)
           for i, q in enumerate(leaves) if _is_q(q)}
  if not theta:
    raise ValueError("scale tuning needs a quantized model (no QArray weights found)")
  teacher_graphdef, teacher_state = nnx.split(teacher)
  steps_per_epoch = len(ids) // batch
  total = epochs * steps_per_epoch
  schedule = optax.cosine_decay_schedule(lr, total)
  tx = optax.adam(schedule)
  loss_fn = functools.partial(_loss, graphdef=graphdef, treedef=treedef,
                              teacher_graphdef=teacher_graphdef)
  step = jax.jit(functools.partial(objective_step, loss_fn=loss_fn, tx=tx, schedule=schedule),
                 donate_argnums=0)
  train_state = {"params": theta, "opt_state": tx.init(theta), "step": jnp.zeros((), jnp.int32)}
  frozen = {"leaves": leaves, "teacher": teacher_state}
  rng = np.random.default_rng(seed)
  kls = []
  for epoch in range(epochs):
    order = rng.permutation(len(ids))
    for i in range(steps_per_epoch):
      rows = ids[order[i * batch:(i + 1) * batch]]
      train_state, metrics = step(train_state, {"ids": jnp.asarray(rows)}, frozen)
      kls.append(float(metrics["kl"]))
      if log is not None:
        log(f"scale tuning epoch {epoch} step {i}: kl {kls[-1]:.4f}")
  tuned = _scaled(leaves, train_state["params"])
  for key in theta:
    q = tuned[int(key)]
    tuned[int(key)] = dataclasses.replace(q, scale=q.scale.astype(jnp.float16))
  nnx.update(model, jax.tree.unflatten(treedef, tuned))
  return {"kl": kls, "steps": total}
