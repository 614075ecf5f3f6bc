"""Logit knowledge distillation (Hinton et al. 2015): the loss that distillation training
(align/distill.py) and quantized scale tuning (infer/quant/tune.py) both minimise."""

import jax
import jax.numpy as jnp


def masked_mean(x_BT, mask_BT):
  """Mean of x over the positions where mask is 1 (0 when the mask is empty)."""
  return jnp.sum(x_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)


def top1_agreement(student_logits_BTV, teacher_logits_BTV, mask_BT):
  """Share of masked positions where student and teacher argmax agree."""
  same_BT = jnp.argmax(student_logits_BTV, -1) == jnp.argmax(teacher_logits_BTV, -1)
  return masked_mean(same_BT.astype(jnp.float32), jnp.asarray(mask_BT, jnp.float32))


def distill_loss(student_logits_BTV, teacher_logits_BTV, targets_BT, mask_BT, *,
                 temperature: float = 2.0, alpha: float = 0.5):
  """Hinton KD: α·T²·KL(p_teacher^T ‖ p_student^T) + (1−α)·CE(student, targets).

  p^T = softmax(logits/T); both terms are means over masked tokens. T² keeps the
  soft term's gradient scale independent of T. The teacher gets no gradient.
  Returns (loss, metrics): kl (at T, unscaled), ce, top1_agreement.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
  if jnp.shape(student_logits_BTV) != jnp.shape(teacher_logits_BTV):
    raise ValueError(f"shape mismatch: student logits {jnp.shape(student_logits_BTV)} vs "
                     f"teacher logits {jnp.shape(teacher_logits_BTV)}")
  if jnp.ndim(student_logits_BTV) != 3 or jnp.shape(targets_BT) != jnp.shape(student_logits_BTV)[:2] \
     or jnp.shape(mask_BT) != jnp.shape(targets_BT):
    raise ValueError(f"shape mismatch: logits {jnp.shape(student_logits_BTV)}, targets "
                     f"{jnp.shape(targets_BT)}, mask {jnp.shape(mask_BT)} (want [B,T,V], [B,T], [B,T])")
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  student_BTV = jnp.asarray(student_logits_BTV, jnp.float32)
  teacher_BTV = jax.lax.stop_gradient(jnp.asarray(teacher_logits_BTV, jnp.float32))
  s_logp_BTV = jax.nn.log_softmax(student_BTV / temperature, -1)
  t_logp_BTV = jax.nn.log_softmax(teacher_BTV / temperature, -1)
  kl_BT = jnp.sum(jnp.exp(t_logp_BTV) * (t_logp_BTV - s_logp_BTV), -1)
  logp_BTV = jax.nn.log_softmax(student_BTV, -1)
  ce_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]
  kl, ce = masked_mean(kl_BT, mask_BT), masked_mean(ce_BT, mask_BT)
  loss = alpha * temperature**2 * kl + (1.0 - alpha) * ce
  metrics = {"kl": kl, "ce": ce,
             "top1_agreement": top1_agreement(student_BTV, teacher_BTV, mask_BT)}
  return loss, jax.lax.stop_gradient(metrics)
