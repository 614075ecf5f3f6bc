"""Alignment losses (align/preference.py, align/rl.py) against closed forms and TRL.

Expected values are computed here with numpy/math, never by the code under test; the
comparisons with TRL's own code run in tests/test_align_trl.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from align import preference, rl
from train import distillation

RNG = np.random.default_rng(0)


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


# Hand-built per-sequence log-probs: Δ = (πc − rc) − (πr − rr) = [3, -3, 0.5].
PC = np.array([-10.0, -20.0, -5.0])
PR = np.array([-14.0, -15.0, -6.0])
RC = np.array([-11.0, -19.0, -5.5])
RR = np.array([-12.0, -17.0, -6.0])
DELTA = (PC - RC) - (PR - RR)


def test_delta_fixture():
  np.testing.assert_allclose(DELTA, [3.0, -3.0, 0.5])


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0),
                                           ("hinge", 0.0), ("robust", 0.0), ("robust", 0.2)])
def test_dpo_losses_match_closed_form(loss_type, eps):
  beta = 0.5
  z = beta * DELTA
  expected = {
      "sigmoid": -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z),  # cDPO form
      "ipo": (DELTA - 1 / (2 * beta)) ** 2,
      "hinge": np.maximum(0.0, 1 - z),
      "robust": (-(1 - eps) * _log_sigmoid(z) + eps * _log_sigmoid(-z)) / (1 - 2 * eps),
  }[loss_type]
  loss_B, m = preference.dpo_loss(PC, PR, RC, RR, beta=beta, loss_type=loss_type, label_smoothing=eps)
  np.testing.assert_allclose(loss_B, expected, rtol=1e-6, atol=1e-6)
  rc, rr = beta * (PC - RC), beta * (PR - RR)
  np.testing.assert_allclose(m["rewards/chosen"], rc.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/rejected"], rr.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/margins"], (rc - rr).mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/accuracies"], 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["logps/chosen"], PC.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["logps/rejected"], PR.mean(), rtol=1e-6)


def test_dpo_beta_applied_once():
  # Δ = 3 at β = 0.1: −log σ(0.3), not −log σ(0.03) (the historical double-β bug).
  loss_B, _ = preference.dpo_loss(PC[:1], PR[:1], RC[:1], RR[:1], beta=0.1)
  np.testing.assert_allclose(loss_B[0], math.log1p(math.exp(-0.3)), rtol=1e-6)


def test_robust_with_no_smoothing_equals_sigmoid():
  a, _ = preference.dpo_loss(PC, PR, RC, RR, loss_type="robust")
  b, _ = preference.dpo_loss(PC, PR, RC, RR, loss_type="sigmoid")
  np.testing.assert_allclose(a, b, rtol=1e-7)


def test_ipo_length_normalisation():
  beta, lc, lr = 0.1, np.array([4.0, 2.0, 1.0]), np.array([2.0, 5.0, 0.0])
  loss_B, m = preference.dpo_loss(PC, PR, RC, RR, beta=beta, loss_type="ipo",
                                  chosen_lengths_B=lc, rejected_lengths_B=lr)
  d = (PC - RC) / lc - (PR - RR) / np.maximum(lr, 1.0)  # an empty response counts as 1 token
  np.testing.assert_allclose(loss_B, (d - 1 / (2 * beta)) ** 2, rtol=1e-6)
  np.testing.assert_allclose(m["rewards/margins"], (beta * DELTA).mean(), rtol=1e-6)  # summed logps


def test_dpo_policy_equals_reference_gives_log2_and_zero_rewards():
  logps = RNG.normal(-30.0, 5.0, 8)
  logps_r = RNG.normal(-30.0, 5.0, 8)
  loss_B, m = preference.dpo_loss(logps, logps_r, logps, logps_r, beta=0.1)
  np.testing.assert_array_equal(np.asarray(loss_B), np.float32(math.log(2)))
  for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
    assert float(m[k]) == 0.0, k


def test_dpo_reference_gets_no_gradient_and_policy_does():
  def total(pc, pr, rc, rr):
    return jnp.mean(preference.dpo_loss(pc, pr, rc, rr, beta=0.1)[0])

  grads = jax.grad(total, argnums=(0, 1, 2, 3))(*(jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR)))
  np.testing.assert_array_equal(grads[2], 0.0)
  np.testing.assert_array_equal(grads[3], 0.0)
  # d/dπc of −log σ(βΔ)/B = −β·σ(−βΔ)/B
  np.testing.assert_allclose(grads[0], -0.1 * (1 - 1 / (1 + np.exp(-0.1 * DELTA))) / 3, rtol=1e-5)
  np.testing.assert_allclose(grads[1], -np.asarray(grads[0]), rtol=1e-6)


def test_dpo_reference_free():
  loss_B, m = preference.dpo_loss(PC, PR, None, None, beta=0.2, reference_free=True)
  np.testing.assert_allclose(loss_B, -_log_sigmoid(0.2 * (PC - PR)), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/chosen"], 0.2 * PC.mean(), rtol=1e-6)


def test_losses_jit_like_eager():
  eager, _ = preference.dpo_loss(PC, PR, RC, RR, loss_type="robust", label_smoothing=0.1)
  jitted, _ = jax.jit(lambda *a: preference.dpo_loss(*a, loss_type="robust", label_smoothing=0.1))(
      PC, PR, RC, RR)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6)
  r, v, mask = RNG.normal(size=(2, 5)), RNG.normal(size=(2, 5)), np.ones((2, 5))
  np.testing.assert_allclose(jax.jit(rl.gae)(r, v, mask)[0], rl.gae(r, v, mask)[0], rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_type="kto"), "loss_type"), (dict(beta=0.0), "beta"), (dict(beta=-1.0), "beta"),
    (dict(label_smoothing=0.5), "label_smoothing"), (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing"),
    (dict(chosen_lengths_B=np.ones(3), rejected_lengths_B=np.ones(3)), "ipo")])
def test_dpo_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    preference.dpo_loss(PC, PR, RC, RR, **kwargs)


def test_dpo_shape_mismatch_and_missing_reference():
  with pytest.raises(ValueError, match="shape mismatch"):
    preference.dpo_loss(PC, PR[:2], RC, RR)
  with pytest.raises(ValueError, match="ref_chosen_logps_B"):
    preference.dpo_loss(PC, PR)


def test_reward_loss_bradley_terry_with_margin_and_centring():
  rc, rr, margin = np.array([1.0, -0.5, 2.0, 0.3]), np.array([0.0, 0.5, -1.0, 0.3]), np.array([0.5, 0, 1, 0])
  loss, m = preference.reward_loss(rc, rr, margin_B=margin, center_coef=0.01)
  expected = np.mean(-_log_sigmoid(rc - rr - margin)) + 0.01 * np.mean((rc + rr) ** 2)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(m["accuracy"], 0.5)  # a tie is not a win
  np.testing.assert_allclose(m["rewards/margin"], np.mean(rc - rr), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/std"], np.std(np.concatenate([rc, rr])), rtol=1e-6)
  plain, _ = preference.reward_loss(rc, rr)
  np.testing.assert_allclose(plain, np.mean(np.logaddexp(0.0, -(rc - rr))), rtol=1e-6)
  with pytest.raises(ValueError, match="shape mismatch"):
    preference.reward_loss(rc, rr[:3])


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_distill_loss_closed_form():
  s, t = RNG.normal(size=(2, 3, 5)), RNG.normal(size=(2, 3, 5)) * 2
  targets, mask = RNG.integers(0, 5, (2, 3)), np.array([[1, 1, 0], [0, 1, 1]], np.float32)
  T, alpha = 2.0, 0.3
  ps, pt = _softmax(s / T), _softmax(t / T)
  kl = (pt * (np.log(pt) - np.log(ps))).sum(-1)
  ce = -np.log(np.take_along_axis(_softmax(s), targets[..., None], -1)[..., 0])
  kl_m, ce_m = (kl * mask).sum() / mask.sum(), (ce * mask).sum() / mask.sum()
  loss, m = distillation.distill_loss(s, t, targets, mask, temperature=T, alpha=alpha)
  np.testing.assert_allclose(loss, alpha * T * T * kl_m + (1 - alpha) * ce_m, rtol=1e-5)
  np.testing.assert_allclose(m["kl"], kl_m, rtol=1e-5)
  agree = (s.argmax(-1) == t.argmax(-1)).astype(np.float32)
  np.testing.assert_allclose(m["top1_agreement"], (agree * mask).sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(distillation.top1_agreement(s, s, mask), 1.0)
  # The teacher receives no gradient.
  g = jax.grad(lambda tt: distillation.distill_loss(s, tt, targets, mask)[0])(jnp.asarray(t, jnp.float32))
  np.testing.assert_array_equal(g, 0.0)
  with pytest.raises(ValueError, match="temperature"):
    distillation.distill_loss(s, t, targets, mask, temperature=0.0)
  with pytest.raises(ValueError, match="shape mismatch"):
    distillation.distill_loss(s, t[:, :2], targets, mask)


def test_kl_estimators():
  lp, ref = np.array([[-1.0, -2.0, -0.5]]), np.array([[-1.5, -1.0, -0.5]])
  np.testing.assert_allclose(rl.kl_penalty(lp, ref, "k1"), lp - ref, rtol=1e-6)
  r = np.exp(ref - lp)
  np.testing.assert_allclose(rl.kl_penalty(lp, ref, "k3"), (r - 1) - np.log(r), rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="kind"):
    rl.kl_penalty(lp, ref, "k2")


def test_per_token_rewards():
  kl = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]])
  mask = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
  out = rl.per_token_rewards(np.array([2.0, -1.0, 5.0]), kl, mask, kl_coef=0.1)
  expected = np.array([[0, -0.02, -0.03 + 2.0, 0], [-0.05, -0.05, -0.05, -0.05 - 1.0], [0, 0, 0, 0]])
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def _gae_loop(rewards, values, mask, gamma, lam):
  """Plain reverse loop: padding positions are skipped (not in the episode)."""
  adv = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    next_v, next_a = 0.0, 0.0
    for t in reversed(range(rewards.shape[1])):
      if not mask[b, t]:
        continue
      delta = rewards[b, t] + gamma * next_v - values[b, t]
      next_a = delta + gamma * lam * next_a
      adv[b, t], next_v = next_a, values[b, t]
  return adv, np.where(mask > 0, adv + values, 0.0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_reverse_loop(gamma, lam):
  B, T = 5, 9
  rewards, values = RNG.normal(size=(B, T)), RNG.normal(size=(B, T))
  mask = (RNG.random((B, T)) > 0.3).astype(np.float32)
  mask[0] = 0  # a row with no response tokens
  mask[1, :3], mask[1, 3:7], mask[1, 7:] = 0, 1, 0  # prompt, response, right padding
  adv, ret = rl.gae(rewards, values, mask, gamma=gamma, lam=lam)
  adv_ref, ret_ref = _gae_loop(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-6)
  # Garbage under the mask changes nothing.
  adv2, _ = rl.gae(np.where(mask > 0, rewards, 99.0), np.where(mask > 0, values, -99.0), mask, gamma, lam)
  np.testing.assert_allclose(adv2, adv, rtol=1e-6)


def test_gae_right_padding_matches_trl_zero_fill():
  # TRL's PPO zero-fills rewards and values at padding and runs GAE over every column.
  B, T = 3, 6
  rewards, values = RNG.normal(size=(B, T)), RNG.normal(size=(B, T))
  mask = (np.arange(T)[None, :] < np.array([[6], [4], [1]])).astype(np.float32)
  r0, v0 = rewards * mask, values * mask
  last, adv_rev = 0.0, []
  for t in reversed(range(T)):
    next_v = v0[:, t + 1] if t < T - 1 else 0.0
    last = r0[:, t] + next_v - v0[:, t] + 0.95 * last
    adv_rev.append(last)
  adv_trl = np.stack(adv_rev[::-1], 1)
  adv, _ = rl.gae(rewards, values, mask)
  np.testing.assert_allclose(adv, adv_trl * mask, rtol=1e-5, atol=1e-6)


def test_whiten():
  x, mask = RNG.normal(3.0, 2.0, (3, 4)), np.array([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 1, 1]])
  vals = x[mask > 0]
  w = np.asarray(rl.whiten(x, mask))
  np.testing.assert_allclose(w[mask > 0], (vals - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8), rtol=1e-5)
  np.testing.assert_array_equal(w[mask == 0], 0.0)
  w2 = np.asarray(rl.whiten(x, mask, shift_mean=False))
  np.testing.assert_allclose(w2[mask > 0], w[mask > 0] + vals.mean(), rtol=1e-5)


def test_ppo_policy_loss_clipped_and_unclipped_cases():
  # ratios 1.5 / 0.5 / 1.1 / 0.7 / 1.3(masked); advantages ±
  ratio = np.array([[1.5, 0.5, 1.1, 0.7, 1.3]])
  adv = np.array([[1.0, -2.0, 3.0, 1.0, 1.0]])
  mask = np.array([[1, 1, 1, 1, 0]])
  old = np.full((1, 5), -2.0)
  logps = old + np.log(ratio)
  # token 0: A>0, ρ>1.2 -> clipped: −1.2;   token 1: A<0, ρ<0.8 -> clipped: 2·0.8 = 1.6
  # token 2: inside the range -> −3.3;      token 3: A>0, ρ<0.8 -> unclipped −0.7 (max picks it)
  expected = np.mean([-1.2, 1.6, -3.3, -0.7])
  loss, m = rl.ppo_policy_loss(logps, old, adv, mask, clip=0.2)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(m["clipfrac"], 0.5)
  np.testing.assert_allclose(m["approx_kl"], np.mean(0.5 * np.log(ratio[0, :4]) ** 2), rtol=1e-5)
  # clip_high widens the upper side only: token 0 now unclipped at 1.5 < 1 + 0.6.
  loss_hi, m_hi = rl.ppo_policy_loss(logps, old, adv, mask, clip=0.2, clip_high=0.6)
  np.testing.assert_allclose(loss_hi, np.mean([-1.5, 1.6, -3.3, -0.7]), rtol=1e-5)
  np.testing.assert_allclose(m_hi["clipfrac"], 0.25)
  # The gradient through a clipped token is zero.
  g = jax.grad(lambda lp: rl.ppo_policy_loss(lp, old, adv, mask)[0])(jnp.asarray(logps, jnp.float32))
  np.testing.assert_allclose(np.asarray(g)[0], [0, 0, -3.3 / 4, -0.7 / 4, 0], rtol=1e-5, atol=1e-7)


def test_ppo_value_loss():
  v, old = np.array([[1.0, 0.0, 2.0]]), np.array([[0.5, 0.1, 0.0]])
  ret, mask = np.array([[2.0, -1.0, 0.0]]), np.array([[1, 1, 1]])
  # clipped values: 0.7, 0.0, 0.2 -> squared errors unclipped (1, 1, 4), clipped (1.69, 1, 0.04)
  loss, m = rl.ppo_value_loss(v, old, ret, mask, clip=0.2)
  np.testing.assert_allclose(loss, 0.5 * np.mean([1.69, 1.0, 4.0]), rtol=1e-5)
  np.testing.assert_allclose(m["vf_clipfrac"], 1 / 3, rtol=1e-6)


def test_entropy():
  logits = RNG.normal(size=(2, 3, 4))
  mask = np.array([[1, 0, 1], [1, 1, 0]])
  p = _softmax(logits)
  h = -(p * np.log(p)).sum(-1)
  np.testing.assert_allclose(rl.entropy(logits, mask), (h * mask).sum() / mask.sum(), rtol=1e-5)
  np.testing.assert_allclose(rl.entropy(np.zeros((1, 1, 8)), np.ones((1, 1))), math.log(8), rtol=1e-6)


def test_kl_controllers():
  ctl = rl.AdaptiveKLController(value=0.2, target=6.0, horizon=10000)
  expected = 0.2
  for kl, n in [(12.0, 256), (6.0, 256), (3.0, 512), (5.4, 128)]:
    err = min(max(kl / 6.0 - 1, -0.2), 0.2)  # 0.2 (clipped from 1), 0, -0.2 (from -0.5), -0.1
    expected *= 1 + err * n / 10000
    np.testing.assert_allclose(ctl.update(kl, n), expected, rtol=1e-12)
  np.testing.assert_allclose(expected, 0.2 * 1.00512 * 0.98976 * 0.99872, rtol=1e-12)
  assert rl.FixedKLController(0.05).update(100.0, 256) == 0.05
  with pytest.raises(ValueError, match="horizon"):
    rl.AdaptiveKLController(value=0.2, target=6.0, horizon=0)


def test_grpo_advantages_per_group():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 1.0, 2.0, 5.0]])
  adv = np.asarray(rl.grpo_advantages(rewards))
  for row, a in zip(rewards, adv):
    np.testing.assert_allclose(a, (row - row.mean()) / (row.std(ddof=1) + 1e-4), rtol=1e-5)
  np.testing.assert_array_equal(adv[1], 0.0)  # equal rewards: no signal
  flat = np.asarray(rl.grpo_advantages(rewards.reshape(-1), group_size=4))
  np.testing.assert_allclose(flat, adv.reshape(-1), rtol=1e-6)
  with pytest.raises(ValueError, match="group_size"):
    rl.grpo_advantages(rewards.reshape(-1), group_size=5)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_grpo_loss_closed_form(loss_type):
  B, T = 4, 5
  old = RNG.normal(-2.0, 0.5, (B, T))
  logps = old + RNG.normal(0.0, 0.3, (B, T))
  ref = old + RNG.normal(0.0, 0.3, (B, T))
  adv = np.array([1.0, -0.5, 0.0, 2.0])
  mask = (np.arange(T)[None, :] < np.array([[5], [3], [1], [4]])).astype(np.float64)
  beta = 0.04
  ratio = np.exp(logps - old)
  per_tok = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.28) * adv[:, None])
  per_tok += beta * (np.exp(ref - logps) - (ref - logps) - 1)
  expected = {"grpo": np.mean((per_tok * mask).sum(1) / mask.sum(1)),
              "bnpo": (per_tok * mask).sum() / mask.sum(),
              "dr_grpo": (per_tok * mask).sum() / (B * 8)}[loss_type]
  loss, m = rl.grpo_loss(logps, old, adv, mask, ref_logps_BT=ref, beta=beta, clip=0.2, clip_high=0.28,
                         loss_type=loss_type, max_completion_length=8)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert 0.0 <= float(m["clipfrac"]) <= 1.0 and float(m["kl"]) > 0.0


def test_grpo_loss_bad_input():
  z = np.zeros((2, 3))
  with pytest.raises(ValueError, match="ref_logps_BT"):
    rl.grpo_loss(z, z, np.zeros(2), z, beta=0.1)
  with pytest.raises(ValueError, match="loss_type"):
    rl.grpo_loss(z, z, np.zeros(2), z, loss_type="ppo")
