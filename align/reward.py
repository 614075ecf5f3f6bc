"""Reward model: a decoder backbone with a scalar head (align/heads.RewardModel), trained
with the Bradley–Terry loss on chosen/rejected pairs (align/preference.reward_loss).

Held-out metrics: pairwise accuracy (r_chosen > r_rejected) with its 95% Wilson interval,
the BT loss, and the mean and spread of rewards.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from align.datasets import join_pairs, pair_valid
from align.heads import RewardModel
from align.logprobs import split_pairs
from align.preference import reward_loss
from align.tasks import AlignTask, pair_sums, wilson_interval
from models import ConfigError


class RewardTask(AlignTask):
  name = "rm"

  def validate(self):
    super().validate()
    if self.align.rm.center_coef < 0 or self.align.rm.head_std < 0:
      raise ConfigError(f"align.rm: center_coef={self.align.rm.center_coef} and head_std="
                        f"{self.align.rm.head_std} must be >= 0")

  def build_module(self, plan, rngs):
    return RewardModel.create(plan.model_cfg, rngs, head_std=self.align.rm.head_std)

  def with_pretrained(self, params, pretrained):
    return nnx.State({"backbone": pretrained, "head": params["head"]})

  def extra_trainables(self, params):
    return {"head": params["head"]}  # the head is new: trained in full even under LoRA

  def rewards(self, trainable, frozen, batch):
    """(chosen_B, rejected_B) rewards."""
    return split_pairs(self.policy(trainable, frozen)(join_pairs(batch)))

  def loss(self, trainable, frozen, batch):
    chosen_B, rejected_B = self.rewards(trainable, frozen, batch)
    return reward_loss(chosen_B, rejected_B, center_coef=self.align.rm.center_coef)

  def eval_sums(self, trainable, frozen, batch):
    chosen_B, rejected_B = self.rewards(trainable, frozen, batch)
    margin_B = chosen_B - rejected_B
    per_pair = {"accuracy": margin_B > 0, "loss": -jax.nn.log_sigmoid(margin_B),
                "margin": margin_B, "rewards/chosen": chosen_B, "rewards/rejected": rejected_B,
                "rewards/sq": 0.5 * (chosen_B ** 2 + rejected_B ** 2)}
    return pair_sums(per_pair, pair_valid(batch))

  def finish_eval(self, out, n):
    low, high = wilson_interval(out["val_accuracy"] * n, n)
    out["val_accuracy_ci_low"], out["val_accuracy_ci_high"] = low, high
    mean = 0.5 * (out["val_rewards/chosen"] + out["val_rewards/rejected"])
    out["val_rewards/std"] = float(jnp.sqrt(max(out.pop("val_rewards/sq") - mean ** 2, 0.0)))
    return out
