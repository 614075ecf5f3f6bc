"""RL pieces for PPO (RLHF) and GRPO: KL estimators, per-token rewards, GAE, clipped losses.

Pure jnp functions on [B, T] arrays aligned with the response tokens; mask_BT is
1 on response tokens and 0 on prompt and padding, which contribute nothing.
Conventions follow TRL (REFERENCES.md, "Preference and RL losses"): γ = 1, λ = 0.95,
clip 0.2, k3 KL for GRPO, group std with Bessel's correction and eps 1e-4.
The KL controllers are host-side Python objects: their value feeds the next step.
"""

import dataclasses

import jax
import jax.numpy as jnp

KL_KINDS = ("k1", "k3")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _check_shapes(**arrays):
  shapes = {name: jnp.shape(a) for name, a in arrays.items()}
  first = next(iter(shapes.values()))
  if any(s != first for s in shapes.values()):
    raise ValueError(f"shape mismatch: {shapes}")


def masked_mean(x_BT, mask_BT, axis=None):
  """Σ x·m / max(Σ m, 1): masked positions do not count."""
  mask_BT = _f32(mask_BT)
  return jnp.sum(x_BT * mask_BT, axis) / jnp.maximum(jnp.sum(mask_BT, axis), 1.0)


def kl_penalty(logps_BT, ref_logps_BT, kind: str = "k1"):
  """Per-token KL(π‖π_ref) estimate from sampled-token log-probs.

  k1 = log π − log π_ref (unbiased, can be negative); k3 = (r − 1) − log r with
  r = π_ref/π (unbiased, always ≥ 0, lower variance; Schulman's estimator).
  """
  if kind not in KL_KINDS:
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")
  _check_shapes(logps_BT=logps_BT, ref_logps_BT=ref_logps_BT)
  log_r_BT = _f32(ref_logps_BT) - _f32(logps_BT)
  if kind == "k1":
    return -log_r_BT
  return jnp.expm1(log_r_BT) - log_r_BT  # expm1: exact near r = 1


def per_token_rewards(score_B, kl_BT, mask_BT, kl_coef):
  """RLHF reward: −kl_coef·KL_t on every response token, plus the sequence score at
  each row's last response token (its EOS). A row without response tokens gets 0."""
  _check_shapes(kl_BT=kl_BT, mask_BT=mask_BT)
  if jnp.shape(score_B) != jnp.shape(mask_BT)[:1]:
    raise ValueError(f"shape mismatch: score_B {jnp.shape(score_B)} vs mask_BT {jnp.shape(mask_BT)}")
  mask_BT = _f32(mask_BT)
  T = mask_BT.shape[1]
  # Last response position: the first 1 when scanning the row backwards.
  last_B = T - 1 - jnp.argmax(mask_BT[:, ::-1] > 0, axis=1)
  has_any_B = jnp.any(mask_BT > 0, axis=1)
  at_last_BT = (jnp.arange(T)[None, :] == last_B[:, None]) & has_any_B[:, None]
  return -kl_coef * _f32(kl_BT) * mask_BT + jnp.where(at_last_BT, _f32(score_B)[:, None], 0.0)


def gae(rewards_BT, values_BT, mask_BT, gamma: float = 1.0, lam: float = 0.95):
  """Generalised advantage estimation, as a reverse scan over T.

  δ_t = r_t + γ·V_next − V_t;  A_t = δ_t + γλ·A_next;  returns = A + V.
  Masked positions are skipped: they carry (V_next, A_next) through unchanged and
  get A = returns = 0, so the value after the last response token is 0 (episode
  end), as TRL's zero-filled padding gives for right padding.
  """
  _check_shapes(rewards_BT=rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
  rewards_TB, values_TB = _f32(rewards_BT).T, _f32(values_BT).T
  real_TB = _f32(mask_BT).T > 0

  def step(carry, xs):
    next_value_B, next_adv_B = carry
    reward_B, value_B, real_B = xs
    delta_B = reward_B + gamma * next_value_B - value_B
    adv_B = delta_B + gamma * lam * next_adv_B
    carry = (jnp.where(real_B, value_B, next_value_B), jnp.where(real_B, adv_B, next_adv_B))
    return carry, jnp.where(real_B, adv_B, 0.0)

  zeros_B = jnp.zeros(rewards_TB.shape[1], jnp.float32)
  _, adv_TB = jax.lax.scan(step, (zeros_B, zeros_B), (rewards_TB, values_TB, real_TB), reverse=True)
  advantages_BT = adv_TB.T
  returns_BT = jnp.where(real_TB.T, advantages_BT + values_BT, 0.0)
  return advantages_BT, returns_BT


def whiten(x_BT, mask_BT, shift_mean: bool = True, eps: float = 1e-8):
  """(x − mean)/sqrt(var + eps) over masked positions (TRL's masked_whiten: unbiased
  variance); shift_mean=False adds the mean back. Masked positions become 0. The statistics
  are over all of x_BT: jitted over a global batch (align/ppo.py), every process's rows."""
  _check_shapes(x_BT=x_BT, mask_BT=mask_BT)
  x_BT, mask_BT = _f32(x_BT), _f32(mask_BT)
  n = jnp.sum(mask_BT)
  mean = masked_mean(x_BT, mask_BT)
  var = masked_mean((x_BT - mean) ** 2, mask_BT) * n / jnp.maximum(n - 1.0, 1.0)  # Bessel
  out_BT = (x_BT - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out_BT = out_BT + mean
  return out_BT * mask_BT


def ppo_policy_loss(logps_BT, old_logps_BT, advantages_BT, mask_BT, clip: float = 0.2,
                    clip_high=None):
  """PPO clipped surrogate: masked mean of max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε_high)), ρ = π/π_old.

  clip_high (DAPO's "clip higher") defaults to clip. Metrics: clipfrac (share of
  tokens where the clipped term is the larger loss), approx_kl = mean ½(log ρ)².
  """
  clip_high = clip if clip_high is None else clip_high
  if not (0 < clip < 1 and clip_high > 0):
    raise ValueError(f"clip must lie in (0, 1) and clip_high be > 0, got {clip}, {clip_high}")
  _check_shapes(logps_BT=logps_BT, old_logps_BT=old_logps_BT, advantages_BT=advantages_BT,
                mask_BT=mask_BT)
  log_ratio_BT = _f32(logps_BT) - jax.lax.stop_gradient(_f32(old_logps_BT))
  ratio_BT = jnp.exp(log_ratio_BT)
  adv_BT = jax.lax.stop_gradient(_f32(advantages_BT))
  unclipped_BT = -adv_BT * ratio_BT
  clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip, 1.0 + clip_high)
  loss = masked_mean(jnp.maximum(unclipped_BT, clipped_BT), mask_BT)
  metrics = {"clipfrac": masked_mean((clipped_BT > unclipped_BT).astype(jnp.float32), mask_BT),
             "approx_kl": masked_mean(0.5 * log_ratio_BT**2, mask_BT)}
  return loss, jax.lax.stop_gradient(metrics)


def ppo_value_loss(values_BT, old_values_BT, returns_BT, mask_BT, clip: float = 0.2):
  """½·masked mean of max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²). Metric: vf_clipfrac."""
  if not clip > 0:
    raise ValueError(f"value clip must be > 0, got {clip}")
  _check_shapes(values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT,
                mask_BT=mask_BT)
  values_BT = _f32(values_BT)
  old_BT = jax.lax.stop_gradient(_f32(old_values_BT))
  returns_BT = jax.lax.stop_gradient(_f32(returns_BT))
  clipped_BT = old_BT + jnp.clip(values_BT - old_BT, -clip, clip)
  loss_unclipped_BT = (values_BT - returns_BT) ** 2
  loss_clipped_BT = (clipped_BT - returns_BT) ** 2
  loss = 0.5 * masked_mean(jnp.maximum(loss_unclipped_BT, loss_clipped_BT), mask_BT)
  metrics = {"vf_clipfrac": masked_mean((loss_clipped_BT > loss_unclipped_BT).astype(jnp.float32),
                                        mask_BT)}
  return loss, jax.lax.stop_gradient(metrics)


def entropy(logits_BTV, mask_BT):
  """Masked mean over tokens of H = −Σ_v p_v log p_v (the entropy bonus)."""
  if jnp.shape(logits_BTV)[:2] != jnp.shape(mask_BT):
    raise ValueError(f"shape mismatch: logits {jnp.shape(logits_BTV)} vs mask {jnp.shape(mask_BT)}")
  logp_BTV = jax.nn.log_softmax(_f32(logits_BTV), -1)
  return masked_mean(-jnp.sum(jnp.exp(logp_BTV) * logp_BTV, -1), mask_BT)


@dataclasses.dataclass
class FixedKLController:
  """A constant kl_coef."""
  value: float

  def update(self, current_kl: float, n_steps: int) -> float:
    del current_kl, n_steps
    return self.value


@dataclasses.dataclass
class AdaptiveKLController:
  """Ziegler et al. (2019): err = clip(KL/target − 1, ±0.2); kl_coef *= 1 + err·n_steps/horizon.

  Raises the coefficient when the policy drifts past the target KL, lowers it below.
  """
  value: float
  target: float
  horizon: float

  def __post_init__(self):
    if not (self.value > 0 and self.target > 0 and self.horizon > 0):
      raise ValueError(f"init kl_coef, target and horizon must be > 0, got {self.value}, "
                       f"{self.target}, {self.horizon}")

  def update(self, current_kl: float, n_steps: int) -> float:
    err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
    self.value *= 1.0 + err * n_steps / self.horizon
    return self.value


def grpo_advantages(rewards, group_size=None, eps: float = 1e-4):
  """(r − mean_group)/(std_group + eps), std with Bessel's correction (as TRL).

  rewards: [B, G] (one row per prompt), or [B·G] with group_size=G where each
  prompt's G completions are consecutive. The result has the input's shape.
  """
  rewards = _f32(rewards)
  if rewards.ndim == 1:
    if group_size is None or group_size < 2 or rewards.shape[0] % group_size:
      raise ValueError(f"flat rewards of length {rewards.shape[0]} need a group_size >= 2 that "
                       f"divides it, got {group_size}")
    rewards_BG = rewards.reshape(-1, group_size)
  elif rewards.ndim == 2:
    if group_size not in (None, rewards.shape[1]) or rewards.shape[1] < 2:
      raise ValueError(f"rewards_BG {rewards.shape} needs G >= 2 (group_size={group_size})")
    rewards_BG = rewards
  else:
    raise ValueError(f"rewards must be [B, G] or [B*G], got shape {rewards.shape}")
  mean_B1 = jnp.mean(rewards_BG, 1, keepdims=True)
  std_B1 = jnp.std(rewards_BG, 1, keepdims=True, ddof=1)
  return ((rewards_BG - mean_B1) / (std_B1 + eps)).reshape(rewards.shape)


def grpo_loss(logps_BT, old_logps_BT, advantages_B, mask_BT, *, ref_logps_BT=None,
              beta: float = 0.0, clip: float = 0.2, clip_high=None, loss_type: str = "grpo",
              max_completion_length=None):
  """GRPO: per token −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) + β·k3(π‖π_ref), A per sequence.

  Aggregation (TRL's loss_type): "grpo" mean over each sequence's tokens then over
  sequences; "bnpo" mean over all tokens; "dr_grpo" sum / (B·max_completion_length).
  Metrics: clipfrac, kl (when β > 0).
  """
  if loss_type not in GRPO_LOSS_TYPES:
    raise ValueError(f"unknown GRPO loss_type {loss_type!r}; expected one of {GRPO_LOSS_TYPES}")
  if beta < 0:
    raise ValueError(f"beta must be >= 0, got {beta}")
  if beta > 0 and ref_logps_BT is None:
    raise ValueError("beta > 0 needs ref_logps_BT for the KL term")
  if loss_type == "dr_grpo" and not max_completion_length:
    raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
  _check_shapes(logps_BT=logps_BT, old_logps_BT=old_logps_BT, mask_BT=mask_BT)
  if jnp.shape(advantages_B) != jnp.shape(mask_BT)[:1]:
    raise ValueError(f"shape mismatch: advantages_B {jnp.shape(advantages_B)} vs mask {jnp.shape(mask_BT)}")
  mask_BT = _f32(mask_BT)
  adv_BT = jnp.broadcast_to(_f32(advantages_B)[:, None], mask_BT.shape)
  # −min(ρA, clip(ρ)A) = max(−ρA, −clip(ρ)A): the PPO surrogate per token.
  clip_high = clip if clip_high is None else clip_high
  log_ratio_BT = _f32(logps_BT) - jax.lax.stop_gradient(_f32(old_logps_BT))
  ratio_BT = jnp.exp(log_ratio_BT)
  unclipped_BT = -adv_BT * ratio_BT
  clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip, 1.0 + clip_high)
  per_token_BT = jnp.maximum(unclipped_BT, clipped_BT)
  metrics = {"clipfrac": masked_mean((clipped_BT > unclipped_BT).astype(jnp.float32), mask_BT)}
  if beta > 0:
    _check_shapes(logps_BT=logps_BT, ref_logps_BT=ref_logps_BT)
    kl_BT = kl_penalty(logps_BT, jax.lax.stop_gradient(_f32(ref_logps_BT)), "k3")
    per_token_BT = per_token_BT + beta * kl_BT
    metrics["kl"] = masked_mean(kl_BT, mask_BT)
  if loss_type == "grpo":
    loss = jnp.mean(masked_mean(per_token_BT, mask_BT, axis=-1))
  elif loss_type == "bnpo":
    loss = masked_mean(per_token_BT, mask_BT)
  else:
    loss = jnp.sum(per_token_BT * mask_BT) / (mask_BT.shape[0] * max_completion_length)
  return loss, jax.lax.stop_gradient(metrics)
