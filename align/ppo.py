"""PPO (RLHF) on the shared loop: sample, score, a KL-penalised reward, GAE, clipped updates.

Each loop step (`prepare`, then the jitted update, align/onpolicy.py):
  1. sample one completion per prompt from the current policy (temperature, max_new_tokens;
     each process its share of the prompts)
  2. score it: align/rewards.py (a programmatic reward or a reward-model workdir)
  3. on the mesh, over the global batch: old logps, reference logps and values (V_old) of
     every completion token, with
       rewards_BT = -kl_coef * KL_t (k1 or k3, align.ppo.kl_estimator) + score at the last token
     then GAE (gamma, lam) -> advantages (whitened over the global batch) and returns
  4. epochs x minibatches optimizer updates on
       loss = clipped policy loss + vf_coef * clipped value loss - entropy_coef * entropy

Value model: a ScalarHead (align/heads.py, zero-initialised) on the policy's own final hidden
states: one backbone, one forward for logits and values, and the value loss (vf_coef) trains
the shared backbone too. Its params live beside the LM's under "value_head" (full fine-tuning:
in the trainable params; LoRA: in the trained "extra"), so the workdir still loads as a plain
LM (train/checkpoint.restore_params restores the LM's keys only) and a LoRA run's merged
export leaves it out.

KL controller: align.ppo.kl_target = 0 keeps kl_coef fixed; > 0 adapts it each step
(AdaptiveKLController, Ziegler et al.) from the rollout's mean sequence KL (over the
global batch: every process holds the same coefficient). The coefficient
each step uses is written to WORKDIR/kl_controller.jsonl ({"step", "kl_coef"}), and a resumed
(or rolled-back) run reads the value for its step there, so the schedule resumes exactly.

Metrics: reward (mean score), kl (mean per-sequence summed KL estimate), kl_coef,
non_score_reward, clipfrac, approx_kl, policy_loss, value_loss, vf_clipfrac, entropy,
response_length; plus the loop's loss, grad_norm, lr.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from align import rl
from align.heads import ScalarHead
from align.logprobs import response_mask
from align.onpolicy import VALUE, OnPolicyTask
from align.rollout import completion_logps, policy_forward
from models import ConfigError
from train.task import to_global

KL_LEDGER = "kl_controller.jsonl"


class PPOTask(OnPolicyTask):
  name = "ppo"
  section = "ppo"

  def __init__(self, config, workdir):
    super().__init__(config, workdir)
    p = self.rl
    if p.kl_estimator not in rl.KL_KINDS:
      raise ConfigError(f"align.ppo.kl_estimator={p.kl_estimator!r}; choose one of "
                        f"{rl.KL_KINDS}")
    if float(p.kl_target) > 0:
      self.kl_ctl = rl.AdaptiveKLController(float(p.kl_coef), float(p.kl_target),
                                            float(p.kl_horizon))
    else:
      self.kl_ctl = rl.FixedKLController(float(p.kl_coef))
    self._kl_step = None  # the step the controller's value is for
    self._experience = None

  # --- params: the LM and its value head ---

  def initial_params(self, plan):
    params = super().initial_params(plan)  # the LM's (init_from's); sets self.graphdef
    head = ScalarHead(plan.model_cfg, nnx.Rngs(self.config.seed), std=0.0)
    self.value_graphdef, head_params = nnx.split(head, nnx.Param)
    return nnx.State({**dict(params), VALUE: head_params})

  def extra_trainables(self, params):
    return {VALUE: params[VALUE]}  # new: trained in full under LoRA too

  def value_params(self, trainable):
    return trainable["extra"][VALUE] if self.rank else trainable[VALUE]

  def forward(self, trainable, frozen, batch, mask_BT):
    """(logps_BT, values_BT, logits_BTV) of the policy on a rollout batch."""
    model = nnx.merge(self.graphdef, self.policy_params(trainable, frozen))
    x_BTD, logits_BTV = policy_forward(model, batch, self.temperature)
    values_BT = nnx.merge(self.value_graphdef, self.value_params(trainable))(x_BTD)
    return (completion_logps(logits_BTV, batch, mask_BT), jnp.where(mask_BT > 0, values_BT, 0.0),
            logits_BTV)

  # --- the KL coefficient ---

  def kl_coef(self, step: int) -> float:
    """The coefficient step `step` uses (from the ledger after a restart or a rollback)."""
    if isinstance(self.kl_ctl, rl.AdaptiveKLController) and self._kl_step != step:
      value = float(self.rl.kl_coef)
      path = os.path.join(self.workdir, KL_LEDGER)
      if os.path.exists(path):
        with open(path) as f:
          for line in f:
            entry = json.loads(line)
            if entry["step"] == step:
              value = entry["kl_coef"]  # the last entry wins: a rollback's replay rewrites
      # every process must use the same coefficient, and only process 0 writes the ledger
      self.kl_ctl.value = float(multihost_utils.broadcast_one_to_all(np.float64(value)))
    self._kl_step = step
    return self.kl_ctl.value

  def update_kl(self, step: int, mean_kl: float) -> None:
    if not isinstance(self.kl_ctl, rl.AdaptiveKLController):
      return
    value = self.kl_ctl.update(mean_kl, self.config.batch_size)
    self._kl_step = step + 1
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, KL_LEDGER), "a") as f:
        f.write(json.dumps({"step": step + 1, "kl_coef": value}) + "\n")

  # --- rollout -> training fields ---

  def advantages(self, trainable, frozen, batch, kl_coef):
    """The rollout's training fields over the global batch (jitted on the mesh): old logps
    and values, advantages, returns; and the mean sequence KL, for the controller."""
    p = self.rl
    mask_BT = response_mask(batch)
    logps_BT, values_BT, _ = self.forward(trainable, frozen, batch, mask_BT)
    ref_logps_BT = self.logps(self.ref_params(frozen), batch, mask_BT)
    kl_BT = rl.kl_penalty(logps_BT, ref_logps_BT, p.kl_estimator) * mask_BT
    rewards_BT = rl.per_token_rewards(batch["scores"], kl_BT, mask_BT, kl_coef)
    advantages_BT, returns_BT = rl.gae(rewards_BT, values_BT, mask_BT, p.gamma, p.lam)
    if p.whiten_advantages:  # mean and variance over every process's tokens
      advantages_BT = rl.whiten(advantages_BT, mask_BT)
    seq_kl_B = jnp.sum(kl_BT, axis=-1)
    return ({"old_logps": logps_BT, "old_values": values_BT, "advantages": advantages_BT,
             "returns": returns_BT, "seq_kl": seq_kl_B}, jnp.mean(seq_kl_B))

  def experience(self, trainable, frozen, rollout, scores_B, step):
    if self._experience is None:
      tokens, rows = self.field_sharding(2), self.field_sharding(1)
      fields = {"old_logps": tokens, "old_values": tokens, "advantages": tokens,
                "returns": tokens, "seq_kl": rows}
      self._experience = self.jit_on_mesh(self.advantages, (fields, self.field_sharding(0)),
                                          args=2)
    kl_coef = self.kl_coef(step)
    batch = to_global({**rollout.batch, "scores": scores_B}, self.batch_sh)
    fields, mean_kl = self._experience(trainable, frozen, batch, np.float32(kl_coef))
    self.update_kl(step, float(mean_kl))
    return {**batch, **fields, "kl_coef": np.full(len(scores_B), kl_coef, np.float32)}

  # --- the update ---

  def loss(self, trainable, frozen, batch):
    p = self.rl
    mask_BT = response_mask(batch)
    logps_BT, values_BT, logits_BTV = self.forward(trainable, frozen, batch, mask_BT)
    pg_loss, pg_metrics = rl.ppo_policy_loss(logps_BT, batch["old_logps"], batch["advantages"],
                                             mask_BT, clip=p.clip)
    vf_loss, vf_metrics = rl.ppo_value_loss(values_BT, batch["old_values"], batch["returns"],
                                            mask_BT, clip=p.value_clip)
    ent = rl.entropy(logits_BTV, mask_BT)
    loss = pg_loss + p.vf_coef * vf_loss - p.entropy_coef * ent
    kl = jnp.mean(batch["seq_kl"])
    metrics = {"policy_loss": pg_loss, "value_loss": vf_loss, "entropy": ent,
               "reward": jnp.mean(batch["scores"]), "kl": kl,
               "kl_coef": jnp.mean(batch["kl_coef"]),
               "non_score_reward": -jnp.mean(batch["kl_coef"] * batch["seq_kl"]),
               "response_length": jnp.mean(jnp.sum(mask_BT, axis=-1)),
               **pg_metrics, **vf_metrics}
    return loss, jax.lax.stop_gradient(metrics)
