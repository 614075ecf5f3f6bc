"""Supervised fine-tuning: next-token loss on assistant turns only, over packed rows.

  loss = -sum_t mask_BT * log p(target_BT) / sum_t mask_BT

mask_BT is 1 on response tokens of real segments (align/logprobs.response_mask), so prompt
and padding tokens contribute nothing.
"""

import jax.numpy as jnp

from align.logprobs import masked_token_logps, response_mask
from align.tasks import AlignTask


class SFTTask(AlignTask):
  name = "sft"
  pairs = False
  trains_moe = True

  def _nll(self, trainable, frozen, batch):
    logp_BT, stats = masked_token_logps(self.policy(trainable, frozen), batch, with_stats=True)
    return -jnp.sum(logp_BT), jnp.sum(response_mask(batch)), stats

  def loss(self, trainable, frozen, batch):
    nll, n, stats = self._nll(trainable, frozen, batch)
    return nll / jnp.maximum(n, 1.0), self.with_router_stats({"tokens": n}, stats)

  def loss_weight(self, batch):
    return jnp.sum(response_mask(batch))  # a token mean: microbatches weigh by their tokens

  def eval_sums(self, trainable, frozen, batch):
    nll, n, _ = self._nll(trainable, frozen, batch)
    return {"loss": nll, "count": n}

  def finish_eval(self, out, n):
    out["val_ppl"] = float(jnp.exp(out["val_loss"]))
    return out
