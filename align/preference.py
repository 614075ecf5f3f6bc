"""Preference losses: DPO and variants, and the Bradley–Terry reward loss (logit KD is
train/distillation.py).

Pure jnp functions on per-sequence log-probabilities summed over response tokens
(shape [B]); TRL conventions (REFERENCES.md, "Preference and RL losses"). With
Δ = (log πθ(y_w) − log π_ref(y_w)) − (log πθ(y_l) − log π_ref(y_l)):

  sigmoid  −log σ(βΔ); with label smoothing ε the conservative (cDPO) form
           (1−ε)·(−log σ(βΔ)) + ε·(−log σ(−βΔ)), as TRL ≤ 0.x applied it.
           TRL 1.x ignores label_smoothing for "sigmoid"; we keep the cDPO form
           rather than drop a setting silently (ε = 0 gives TRL 1.x exactly).
  ipo      (Δ − 1/(2β))², with each log-ratio divided by its response length
           when token counts are given (TRL does this for IPO only; rewards and
           logps metrics stay on the summed log-probs, as in TRL 1.x).
  hinge    relu(1 − βΔ)
  robust   ((1−ε)·(−log σ(βΔ)) − ε·(−log σ(−βΔ))) / (1−2ε)   (unbiased under flips)

β multiplies Δ exactly once (the historical bug applied it twice). The reference
log-probs pass through stop_gradient: the reference model never gets a gradient.
"""

import jax
import jax.numpy as jnp

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
_SMOOTHED = ("sigmoid", "robust")  # loss types that use label_smoothing


def _check_same_shape(**arrays):
  shapes = {name: jnp.shape(a) for name, a in arrays.items() if a is not None}
  first = next(iter(shapes.values()))
  bad = {n: s for n, s in shapes.items() if s != first}
  if bad:
    raise ValueError(f"shape mismatch: {shapes} (all must equal {first})")
  if len(first) != 1:
    raise ValueError(f"expected per-sequence arrays of shape [B], got {shapes}")


def dpo_loss(policy_chosen_logps_B, policy_rejected_logps_B, ref_chosen_logps_B=None,
             ref_rejected_logps_B=None, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, reference_free: bool = False,
             chosen_lengths_B=None, rejected_lengths_B=None):
  """Per-pair DPO loss_B and metrics (batch means of the implicit rewards
  r = β(log πθ − log π_ref), their margin and accuracy r_w > r_l, and the policy logps).

  reference_free: π_ref ≡ 1 (ref log-probs taken as 0; the ref arguments may be None),
  so rewards are β·log πθ. chosen/rejected_lengths_B: response token counts, only
  for loss_type="ipo" (length normalisation); omit them if the logps are already
  per-token means.
  """
  if loss_type not in DPO_LOSS_TYPES:
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
  if not beta > 0:
    raise ValueError(f"beta must be > 0, got {beta}")
  if not 0.0 <= label_smoothing < 0.5:
    raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
  if label_smoothing and loss_type not in _SMOOTHED:
    raise ValueError(f"label_smoothing={label_smoothing} has no meaning for loss_type {loss_type!r}; "
                     f"only {_SMOOTHED} use it")
  if (chosen_lengths_B is None) != (rejected_lengths_B is None):
    raise ValueError("chosen_lengths_B and rejected_lengths_B must be given together")
  if chosen_lengths_B is not None and loss_type != "ipo":
    raise ValueError(f"token counts normalise only the 'ipo' loss, not {loss_type!r}")
  if reference_free:
    ref_chosen_logps_B = jnp.zeros_like(policy_chosen_logps_B)
    ref_rejected_logps_B = jnp.zeros_like(policy_rejected_logps_B)
  elif ref_chosen_logps_B is None or ref_rejected_logps_B is None:
    raise ValueError("ref_chosen_logps_B and ref_rejected_logps_B are required unless reference_free=True")
  _check_same_shape(policy_chosen_logps_B=policy_chosen_logps_B,
                    policy_rejected_logps_B=policy_rejected_logps_B,
                    ref_chosen_logps_B=ref_chosen_logps_B, ref_rejected_logps_B=ref_rejected_logps_B,
                    chosen_lengths_B=chosen_lengths_B, rejected_lengths_B=rejected_lengths_B)

  f32 = lambda x: jnp.asarray(x, jnp.float32)
  chosen_B, rejected_B = f32(policy_chosen_logps_B), f32(policy_rejected_logps_B)
  # The reference is a constant of the objective: no gradient may reach it.
  ref_chosen_B = jax.lax.stop_gradient(f32(ref_chosen_logps_B))
  ref_rejected_B = jax.lax.stop_gradient(f32(ref_rejected_logps_B))
  chosen_ratio_B = chosen_B - ref_chosen_B
  rejected_ratio_B = rejected_B - ref_rejected_B

  if loss_type == "ipo":
    if chosen_lengths_B is not None:
      # As TRL: at least one token, so an empty response cannot divide by zero.
      chosen_ratio_B = chosen_ratio_B / jnp.maximum(f32(chosen_lengths_B), 1.0)
      rejected_ratio_B = rejected_ratio_B / jnp.maximum(f32(rejected_lengths_B), 1.0)
    loss_B = (chosen_ratio_B - rejected_ratio_B - 1.0 / (2.0 * beta)) ** 2
  else:
    logits_B = beta * (chosen_ratio_B - rejected_ratio_B)  # β applied once, here
    eps = label_smoothing
    if loss_type == "hinge":
      loss_B = jax.nn.relu(1.0 - logits_B)
    elif loss_type == "sigmoid":
      loss_B = -(1.0 - eps) * jax.nn.log_sigmoid(logits_B) - eps * jax.nn.log_sigmoid(-logits_B)
    else:  # robust
      loss_B = (-(1.0 - eps) * jax.nn.log_sigmoid(logits_B)
                + eps * jax.nn.log_sigmoid(-logits_B)) / (1.0 - 2.0 * eps)

  # Metrics on the summed log-probs (TRL logs these for every loss type).
  chosen_rewards_B = jax.lax.stop_gradient(beta * (chosen_B - ref_chosen_B))
  rejected_rewards_B = jax.lax.stop_gradient(beta * (rejected_B - ref_rejected_B))
  metrics = {
      "rewards/chosen": jnp.mean(chosen_rewards_B),
      "rewards/rejected": jnp.mean(rejected_rewards_B),
      "rewards/margins": jnp.mean(chosen_rewards_B - rejected_rewards_B),
      "rewards/accuracies": jnp.mean((chosen_rewards_B > rejected_rewards_B).astype(jnp.float32)),
      "logps/chosen": jnp.mean(jax.lax.stop_gradient(chosen_B)),
      "logps/rejected": jnp.mean(jax.lax.stop_gradient(rejected_B)),
  }
  return loss_B, metrics


def reward_loss(chosen_rewards_B, rejected_rewards_B, *, margin_B=None, center_coef: float = 0.0):
  """Bradley–Terry: mean(−log σ(r_c − r_r − margin)) + c·mean((r_c + r_r)²).

  The centring term (TRL's center_rewards_coefficient) pins the reward's free
  offset near 0. Returns (loss, metrics): accuracy (r_c > r_r), reward means/std,
  mean margin r_c − r_r.
  """
  if center_coef < 0:
    raise ValueError(f"center_coef must be >= 0, got {center_coef}")
  _check_same_shape(chosen_rewards_B=chosen_rewards_B, rejected_rewards_B=rejected_rewards_B,
                    margin_B=margin_B)
  chosen_B = jnp.asarray(chosen_rewards_B, jnp.float32)
  rejected_B = jnp.asarray(rejected_rewards_B, jnp.float32)
  margin = 0.0 if margin_B is None else jnp.asarray(margin_B, jnp.float32)
  loss = -jnp.mean(jax.nn.log_sigmoid(chosen_B - rejected_B - margin))
  if center_coef:
    loss = loss + center_coef * jnp.mean((chosen_B + rejected_B) ** 2)
  both_2B = jnp.concatenate([chosen_B, rejected_B])
  metrics = {
      "accuracy": jnp.mean((chosen_B > rejected_B).astype(jnp.float32)),
      "rewards/chosen": jnp.mean(chosen_B),
      "rewards/rejected": jnp.mean(rejected_B),
      "rewards/mean": jnp.mean(both_2B),
      "rewards/std": jnp.std(both_2B),
      "rewards/margin": jnp.mean(chosen_B - rejected_B),
  }
  return loss, jax.lax.stop_gradient(metrics)
