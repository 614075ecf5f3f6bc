"""Log-probabilities of responses: per token, summed per sequence, chosen/rejected split.

A batch is the [B, T] dict of align/data.py (inputs, targets, segment_ids, positions,
loss_mask): a target counts iff its segment id is not 0 (padding) and its loss_mask is 1
(a response token), so prompt and padding tokens contribute exactly nothing.

  token_logps_BT[b, t]  = log softmax(logits_BTV[b, t])[targets_BT[b, t]]   (float32)
  sequence logps_B[b]   = sum_t mask_BT[b, t] * token_logps_BT[b, t]
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.registry import model_inputs


def token_logps(logits_BTV, targets_BT):
  """log p(target) at every position, in float32."""
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_BTV, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]


def response_mask(batch):
  """mask_BT float32: 1 on targets that count (real tokens with loss_mask 1)."""
  mask_BT = batch["segment_ids"] > 0
  if "loss_mask" in batch:
    mask_BT = mask_BT & (batch["loss_mask"] > 0)
  return mask_BT.astype(jnp.float32)


def masked_token_logps(model, batch, *, with_stats=False):
  """token_logps_BT of `batch`'s targets under `model`, 0 where the mask is 0; with
  `with_stats`, (token_logps_BT, the MoE layers' router statistics: {} for a dense model).

  `where`, not a product: a masked position whose logit is inf/nan stays exactly 0."""
  logits_BTV, stats = model(batch["inputs"], batch["positions"], batch["segment_ids"],
                            **model_inputs(model.cfg, batch), return_stats=True)
  mask_BT = response_mask(batch)
  logps_BT = jnp.where(mask_BT > 0, token_logps(logits_BTV, batch["targets"]), 0.0)
  return (logps_BT, stats) if with_stats else logps_BT


def sequence_logps(model, batch, *, with_stats=False):
  """logps_B: each row's log-probability summed over its response tokens (with_stats: and
  the router statistics, as masked_token_logps)."""
  logps_BT, stats = masked_token_logps(model, batch, with_stats=True)
  logps_B = jnp.sum(logps_BT, axis=-1)
  return (logps_B, stats) if with_stats else logps_B


def forward_logps(graphdef, params, batch):
  """sequence_logps as a pure function of (graphdef, params, batch), for jit and grad
  (the style of train/step.py's forward_loss)."""
  return sequence_logps(nnx.merge(graphdef, params), batch)


def response_lengths(batch):
  """n_B float32: response tokens per row (IPO and length-normalised losses divide by it)."""
  return jnp.sum(response_mask(batch), axis=-1)


def split_pairs(x_2B):
  """(chosen_B, rejected_B) from a pair batch's [2B, ...] output (align/data.pair_batch order)."""
  if x_2B.shape[0] % 2:
    raise ValueError(f"split_pairs needs an even leading dimension (chosen rows, then rejected "
                     f"rows); got shape {x_2B.shape}")
  half = x_2B.shape[0] // 2
  return x_2B[:half], x_2B[half:]
