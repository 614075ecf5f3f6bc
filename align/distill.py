"""Logit distillation: a small student learns a frozen teacher's next-token distribution
(forward KL at temperature T, scaled by T²) mixed with the hard-label loss,
train/distillation.distill_loss:  α·T²·KL(p_teacher^T ‖ p_student^T) + (1−α)·CE.

α = 0 is the hard-label baseline (the teacher is still run, for the agreement metric).
Student and teacher share the tokenizer (the teacher's); the student is usually trained
from scratch (config.model) and is then a natural draft model for speculative decoding.
"""

import os

import jax
import jax.numpy as jnp
from flax import nnx

from align.logprobs import response_mask
from align.tasks import AlignTask
from models import ConfigError, load_pretrained
from train.distillation import distill_loss
from train.workdir import is_workdir, load_trained


class DistillTask(AlignTask):
  name = "distill"
  pairs = False

  def validate(self):
    super().validate()
    d = self.align.distill
    if not d.temperature > 0 or not 0 <= d.alpha <= 1:
      raise ConfigError(f"align.distill: temperature={d.temperature} must be > 0 and "
                        f"alpha={d.alpha} in [0, 1]")
    if not d.teacher:
      raise ConfigError("align.distill.teacher: the teacher model (HF dir, .gguf or workdir) "
                        "is required")
    if not os.path.exists(d.teacher):
      raise FileNotFoundError(f"align.distill.teacher: {d.teacher} does not exist")

  def more_frozen(self, plan, params, mesh, layout):
    path = self.align.distill.teacher
    teacher, teacher_tok = (load_trained(path)[:2] if is_workdir(path)
                            else load_pretrained(path))
    probe = "Distillation needs one tokenizer: Hello, world! 12345 \u00e9t\u00e9"
    if teacher.cfg.vocab_size != plan.model_cfg.vocab_size or \
        teacher_tok.encode(probe) != plan.tokenizer.encode(probe):
      raise ConfigError(f"the student's tokenizer ({plan.tokenizer.vocab_size} tokens, model "
                        f"vocab_size {plan.model_cfg.vocab_size}) is not the teacher's "
                        f"({teacher.cfg.vocab_size}): set tokenizer.path to the teacher")
    self.teacher_graphdef, teacher_params = nnx.split(teacher, nnx.Param)
    return {"teacher": self.place(teacher_params, mesh, layout)}

  def _mask(self, batch):
    if self.align.distill.response_only:
      return response_mask(batch)
    return (batch["segment_ids"] > 0).astype(jnp.float32)

  def _terms(self, trainable, frozen, batch):
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    student_BTV = self.policy(trainable, frozen)(*args)
    teacher = nnx.merge(self.teacher_graphdef, frozen["teacher"])
    teacher_BTV = jax.lax.stop_gradient(teacher(*args))
    mask_BT = self._mask(batch)
    d = self.align.distill
    loss, metrics = distill_loss(student_BTV, teacher_BTV, batch["targets"], mask_BT,
                                 temperature=d.temperature, alpha=d.alpha)
    return loss, metrics, jnp.sum(mask_BT)

  def loss(self, trainable, frozen, batch):
    if self.align.distill.alpha == 0:  # hard labels only: no teacher pass while training
      mask_BT = self._mask(batch)
      logits_BTV = self.policy(trainable, frozen)(batch["inputs"], batch["positions"],
                                                  batch["segment_ids"])
      logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), -1)
      ce_BT = -jnp.take_along_axis(logp_BTV, batch["targets"][..., None], -1)[..., 0]
      n = jnp.sum(mask_BT)
      ce = jnp.sum(ce_BT * mask_BT) / jnp.maximum(n, 1.0)
      return ce, {"ce": jax.lax.stop_gradient(ce), "tokens": n}
    loss, metrics, n = self._terms(trainable, frozen, batch)
    return loss, {**metrics, "tokens": n}

  def loss_weight(self, batch):
    return jnp.sum(self._mask(batch))  # a token mean: microbatches weigh by their tokens

  def eval_sums(self, trainable, frozen, batch):
    loss, metrics, n = self._terms(trainable, frozen, batch)
    return {"loss": loss * n, **{k: v * n for k, v in metrics.items()}, "count": n}

  def finish_eval(self, out, n):
    out["val_ppl"] = float(jnp.exp(out["val_ce"]))
    return out
