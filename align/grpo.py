"""GRPO on the shared loop: G completions per prompt, group-normalised advantages, no critic.

Each loop step (`prepare`, then the jitted update, align/onpolicy.py):
  1. batch_size // G prompts, each sampled G times (consecutive rows, seeds per global row;
     each process samples its share of the prompts, whole groups)
  2. scores (align/rewards.py) -> A_b = (r_b - mean_group) / (std_group + eps), one
     advantage per completion (align/rl.grpo_advantages), per group on its own process
  3. old logps (and, with beta > 0, the reference's) of every completion token, on the mesh
  4. epochs x minibatches updates of align/rl.grpo_loss: the clipped surrogate per token
     + beta * k3 KL to the reference (beta = 0: no reference is kept or run)
A group whose G scores are equal has advantage 0: it contributes nothing but the KL term.

Metrics: reward (mean score), reward_std (mean within-group std), kl (beta > 0), clipfrac,
completion_length, zero_std_groups (share of groups with no signal); plus loss, grad_norm, lr.
"""

import jax
import jax.numpy as jnp
import numpy as np

from align import rl
from align.logprobs import response_mask
from align.onpolicy import OnPolicyTask
from models import ConfigError
from train.task import to_global


class GRPOTask(OnPolicyTask):
  name = "grpo"
  section = "grpo"

  def __init__(self, config, workdir):
    super().__init__(config, workdir)
    g = self.rl
    if g.loss_type not in rl.GRPO_LOSS_TYPES:
      raise ConfigError(f"align.grpo.loss_type={g.loss_type!r}; choose one of "
                        f"{rl.GRPO_LOSS_TYPES}")
    if float(g.beta) < 0:
      raise ConfigError(f"align.grpo.beta={g.beta} must be >= 0")
    self._old = None

  def group_size(self) -> int:
    g = int(self.align.grpo.group_size)
    if g < 2:
      raise ConfigError(f"align.grpo.group_size={g} must be >= 2 (advantages are relative)")
    return g

  @property
  def uses_reference(self) -> bool:
    return float(self.rl.beta) > 0

  def old_logps(self, trainable, frozen, batch):
    mask_BT = response_mask(batch)
    out = {"old_logps": self.logps(self.policy_params(trainable, frozen), batch, mask_BT)}
    if self.uses_reference:
      out["ref_logps"] = self.logps(self.ref_params(frozen), batch, mask_BT)
    return out

  def experience(self, trainable, frozen, rollout, scores_B, step):
    if self._old is None:
      self._old = self.jit_on_mesh(self.old_logps, self.field_sharding(2))
    scores_BG = scores_B.reshape(-1, self.group)  # this process's groups, each whole
    advantages_B = np.asarray(rl.grpo_advantages(scores_BG), np.float32).reshape(-1)
    std_B = np.repeat(scores_BG.std(axis=1, ddof=1), self.group).astype(np.float32)
    batch = to_global(rollout.batch, self.batch_sh)
    return {**batch, **self._old(trainable, frozen, batch), "advantages": advantages_B,
            "scores": scores_B, "group_std": std_B}

  def loss(self, trainable, frozen, batch):
    g = self.rl
    mask_BT = response_mask(batch)
    logps_BT = self.logps(self.policy_params(trainable, frozen), batch, mask_BT)
    loss, metrics = rl.grpo_loss(
        logps_BT, batch["old_logps"], batch["advantages"], mask_BT,
        ref_logps_BT=batch.get("ref_logps"), beta=float(g.beta), clip=float(g.clip),
        clip_high=float(g.clip_high) or None, loss_type=g.loss_type,
        max_completion_length=int(g.max_new_tokens))
    metrics = {**metrics, "reward": jnp.mean(batch["scores"]),
               "reward_std": jnp.mean(batch["group_std"]),
               "zero_std_groups": jnp.mean((batch["group_std"] == 0).astype(jnp.float32)),
               "completion_length": jnp.mean(jnp.sum(mask_BT, axis=-1))}
    return loss, jax.lax.stop_gradient(metrics)
