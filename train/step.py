"""Pure, jitted steps: `train_step(state, batch) -> (state, metrics)` and `eval_step`.

A batch is a dict of int32 [B, T] arrays: inputs, targets, segment_ids (0 marks
padding) and positions; optionally loss_mask (1: this target counts; default:
every real token) and the architecture's own inputs (models.registry.EXTRA_INPUTS:
a prefix-LM's `prefix`, an encoder-decoder's `enc_inputs`, `enc_segment_ids`,
`enc_positions`, which are [B, S]). Gradient accumulation splits B into `grad_accum`
microbatches and scans over them, weighting every real token equally, so one
step is exactly one optimizer update on the whole batch.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.registry import model_inputs
from parallel import shards_of
from train import moe_metrics as moe


def token_losses(logits_BTV, targets_BT):
  """Per-token cross-entropy in float32 (optax's), logsumexp minus the target's logit.

  With the vocabulary split over a mesh axis the target's logit is a masked sum
  instead of optax's `take_along_axis`: XLA's SPMD partitioner turned that
  gather and its scatter-add transpose into an all-gather of the
  [B, T, V/tensor] logits over the batch axes, 8x the logits per device for
  llama_70b_pod (docs/parallelism.md). Same value: the other terms are exact
  zeros. Unsplit, the gather stays: XLA:CPU reuses the logits' buffer for its
  transpose, one logits-sized buffer less than the masked sum's gradient.
  """
  logits_BTV = logits_BTV.astype(jnp.float32)
  if shards_of("act_vocab") == 1:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  vocab_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, 2)
  target_BT = jnp.sum(jnp.where(vocab_BTV == targets_BT[..., None], logits_BTV, 0.0), axis=-1)
  return jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT


def forward_loss(graphdef, params, batch):
  """(summed token loss, real-token count, per-layer MoE stats or {})."""
  model = nnx.merge(graphdef, params)
  mask_BT = (batch["segment_ids"] > 0).astype(jnp.float32)
  if "loss_mask" in batch:
    mask_BT = mask_BT * (batch["loss_mask"] > 0).astype(jnp.float32)
  args = (batch["inputs"], batch["positions"], batch["segment_ids"])
  kwargs = dict(return_stats=True, **model_inputs(model.cfg, batch))
  if model.chunked_xent():  # the same loss, without the whole [B, T, V] logits (models/xent.py)
    x_BTD, stats = model.hidden(*args, **kwargs)
    return model.xent_sum(x_BTD, batch["targets"], mask_BT), jnp.sum(mask_BT), stats
  logits_BTV, stats = model(*args, **kwargs)
  loss_sum = jnp.sum(token_losses(logits_BTV, batch["targets"]) * mask_BT)
  return loss_sum, jnp.sum(mask_BT), stats


def loss_sum_and_count(graphdef, params, batch):
  return forward_loss(graphdef, params, batch)[:2]


def train_step(state, batch, *, graphdef, tx, schedule, grad_accum: int = 1,
               inject_nan: bool = False):
  """One optimizer update. A non-finite loss or gradient leaves params and
  optimizer state unchanged (the step still counts) and reports `skipped`=1.
  `inject_nan` poisons the gradients: a test hook for that path."""
  params = state["params"]
  counted_BT = batch["segment_ids"] > 0
  if "loss_mask" in batch:
    counted_BT = counted_BT & (batch["loss_mask"] > 0)
  total_tokens = jnp.maximum(jnp.sum(counted_BT), 1).astype(jnp.float32)
  cfg = nnx.merge(graphdef, params).cfg  # trace-time only: the model's static config

  def micro_loss(p, mb):
    loss_sum, _, stats = forward_loss(graphdef, p, mb)
    loss = loss_sum / total_tokens
    # Router losses are per-microbatch means: each microbatch adds 1/grad_accum of them.
    return loss + moe.router_loss(cfg, stats) / grad_accum, (loss, stats)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  if grad_accum == 1:
    (_, (loss, stats)), grads = grad_fn(params, batch)
  else:
    micro = microbatches(batch, grad_accum)

    def accumulate(carry, mb):
      loss, grads, stats = carry
      (_, (l, s)), g = grad_fn(params, mb)
      return (loss + l, jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, stats, s)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    stats_shape = jax.eval_shape(lambda: forward_loss(
        graphdef, params, jax.tree.map(lambda x: x[0], micro))[2])
    zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)
    (loss, grads, stats), _ = jax.lax.scan(
        accumulate, (jnp.zeros((), jnp.float32), zeros, zero_stats), micro)
    stats = jax.tree.map(lambda s: s / grad_accum, stats)

  new_state, metrics = apply_gradients(
      state, grads, loss, tx=tx, schedule=schedule, inject_nan=inject_nan,
      adjust=lambda new: moe.update_router_bias(cfg, new, params, stats))
  return new_state, {**metrics, "tokens": total_tokens, **moe.router_metrics(cfg, stats)}


def apply_gradients(state, grads, loss, *, tx, schedule, inject_nan=False, adjust=None):
  """The optimizer update every objective shares. A non-finite loss or gradient leaves
  params and optimizer state unchanged (the step still counts) and reports `skipped`=1.
  `adjust(new_params)` may amend the updated params (MoE router biases)."""
  params = state["params"]
  if inject_nan:
    grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, state["opt_state"], params)
  new_params = optax.apply_updates(params, updates)
  if adjust is not None:
    new_params = adjust(new_params)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = dict(state, params=keep(new_params, params),
                   opt_state=keep(opt_state, state["opt_state"]), step=state["step"] + 1)
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]),
             "skipped": 1.0 - finite.astype(jnp.float32)}
  return new_state, metrics


def microbatches(batch, grad_accum: int):
  """[A, B/A, ...] microbatches; microbatch k takes rows k, k+A, k+2A, ...: a slice of every
  device's rows, so microbatches stay sharded like the batch instead of being resharded."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, grad_accum, *x.shape[1:]), 0, 1),
                      batch)


# The metrics key under which an objective hands `objective_step` its policy's MoE router
# statistics (models/moe.py), so that the step adds the router losses to what it
# differentiates and moves the balancing biases, as train_step does for language modelling.
ROUTER_STATS = "router_stats"


def objective_step(state, batch, frozen, *, loss_fn, tx, schedule, grad_accum: int = 1,
                   inject_nan: bool = False, weight_fn=None, moe_cfg=None):
  """One optimizer update on `loss_fn(params, frozen, batch) -> (loss, metrics)`, a mean over
  the batch. Gradient accumulation weights microbatch k by weight_fn(mb_k) / weight_fn(batch)
  (e.g. token counts, for a token mean; None: equally, for a mean over equal-sized row
  groups), so the update equals the whole batch's. `frozen` gets no gradient. Router
  statistics in metrics[ROUTER_STATS] add `moe_cfg`'s router losses, and bias updates to the
  trained params' router_bias_E (a bias in `frozen`, as under LoRA, stays as it is)."""

  def objective(params, frozen, batch):
    loss, aux = loss_fn(params, frozen, batch)
    stats = aux.pop(ROUTER_STATS, {}) if isinstance(aux, dict) else {}
    if stats and moe_cfg is None:
      raise ValueError("objective_step: the loss returned router statistics but no moe_cfg "
                       "says how to weigh them")
    total = loss + moe.router_loss(moe_cfg, stats) if stats else loss
    return total, (loss, aux, stats)

  grad_fn = jax.value_and_grad(objective, has_aux=True)
  params = state["params"]
  if grad_accum == 1:
    (_, (loss, aux, stats)), grads = grad_fn(params, frozen, batch)
  else:
    micro = microbatches(batch, grad_accum)
    total_weight = None if weight_fn is None else jnp.maximum(weight_fn(batch), 1e-9)

    def accumulate(carry, mb):
      (_, (l, a, st)), g = grad_fn(params, frozen, mb)
      w = 1.0 / grad_accum if weight_fn is None else weight_fn(mb) / total_weight
      return jax.tree.map(lambda c, x: c + w * x, carry, (l, a, st, g)), None

    zero = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    _, (_, aux_shape, stats_shape) = jax.eval_shape(
        lambda: objective(params, frozen, jax.tree.map(lambda x: x[0], micro)))
    init = (jnp.zeros((), jnp.float32), zero(aux_shape), zero(stats_shape),
            jax.tree.map(jnp.zeros_like, params))
    (loss, aux, stats, grads), _ = jax.lax.scan(accumulate, init, micro)
  new_state, metrics = apply_gradients(
      state, grads, loss, tx=tx, schedule=schedule, inject_nan=inject_nan,
      adjust=lambda new: moe.update_router_bias(moe_cfg, new, params, stats))
  return new_state, {**aux, **metrics, **moe.router_metrics(moe_cfg, stats)}


def eval_step(params, batch, *, graphdef):
  """Summed loss and token count, so the caller can average over many batches exactly."""
  return loss_sum_and_count(graphdef, params, batch)


def jit_train_step(graphdef, tx, schedule, state_shardings, batch_sharding, grad_accum=1,
                   inject_nan=False):
  step = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           grad_accum=grad_accum, inject_nan=inject_nan)
  return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None), donate_argnums=0)


def jit_eval_step(graphdef, params_shardings, batch_sharding):
  return jax.jit(functools.partial(eval_step, graphdef=graphdef),
                 in_shardings=(params_shardings, batch_sharding))
