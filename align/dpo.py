"""Direct preference optimisation on the shared loop: the policy's summed response
log-probs on chosen and rejected rows (one forward over both, [2B, T]) against the
reference's, through align/preference.dpo_loss (sigmoid, IPO, hinge, robust; reference-free).

The reference is, by `align.dpo.reference`:
  online   recomputed each step: the frozen base under LoRA (one backbone for both), else a
           frozen copy of the starting params
  cached   computed once before training over every pair of both splits, on the run's
           mesh with the layout's shardings (every process passes the same pairs, each
           device scores its rows, every process reads the whole result), saved by process
           0 to WORKDIR/ref_logps_{split}.npz (with a fingerprint of the pairs and weights
           it came from) and carried with the dataset (no reference forward per step; a
           restart reloads the file, unless some process cannot read it: then all compute)
Either way it is frozen: outside the differentiated params, behind stop_gradient.
"""

import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

import parallel
from align.data import pair_batch
from align.datasets import join_pairs, pair_valid
from align.logprobs import forward_logps, response_lengths, sequence_logps, split_pairs
from align.preference import dpo_loss
from align.tasks import AlignTask, pair_sums, wilson_interval
from models import ConfigError
from train.task import batch_sharding, field_sharding

REFERENCES = ("online", "cached")


class DPOTask(AlignTask):
  name = "dpo"
  trains_moe = True

  def __init__(self, config, workdir):
    super().__init__(config, workdir)
    self.cached = self.align.dpo.reference == "cached" and not self.align.dpo.reference_free

  def validate(self):
    super().validate()
    d = self.align.dpo
    if d.reference not in REFERENCES:
      raise ConfigError(f"align.dpo.reference={d.reference!r}; choose one of {REFERENCES}")
    try:  # the loss's own checks (loss_type, beta, label_smoothing), on a dummy pair
      zero = jnp.zeros((1,))
      dpo_loss(zero, zero, zero, zero, beta=d.beta, loss_type=d.loss_type,
               label_smoothing=d.label_smoothing, reference_free=d.reference_free)
    except ValueError as e:
      raise ConfigError(f"align.dpo: {e}") from None

  # --- the reference ---

  def more_frozen(self, plan, params, mesh, layout):
    if self.rank or self.cached or self.align.dpo.reference_free:
      return {}
    return {"ref": jax.tree.map(jnp.copy, params)}  # full fine-tuning: keep the start

  def ref_params(self, frozen):
    return frozen["model"] if self.rank else frozen["ref"]

  def reference_logps(self, frozen, batch, joined):
    """(chosen_B, rejected_B) reference log-probs, or (None, None) when reference-free."""
    if self.align.dpo.reference_free:
      return None, None
    if "ref_chosen_logps" in batch:
      return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    ref = nnx.merge(self.graphdef, self.ref_params(frozen))
    return split_pairs(jax.lax.stop_gradient(sequence_logps(ref, joined)))

  def cached_refs(self, plan, split, pairs):
    if not self.cached or not pairs:
      return None
    path = os.path.join(self.workdir, f"ref_logps_{split}.npz")
    # What the log-probs depend on: a cache from other data, rows or weights is stale.
    digest = hashlib.sha256(f"{self.config.init_from}|{self.config.seq_len}|{self.config.seed}"
                            .encode())
    for chosen, rejected in pairs:
      for ids, mask in (chosen, rejected):
        digest.update(np.asarray(ids, np.int32).tobytes() + np.asarray(mask, np.int8).tobytes())
    fingerprint = digest.hexdigest()
    refs = None
    if os.path.exists(path):
      with np.load(path) as cached:
        if str(cached["fingerprint"]) == fingerprint:
          refs = cached["refs"]
    # Computing is collective: all processes do it unless every one has the file.
    if multihost_utils.process_allgather(np.asarray(refs is not None)).all():
      return refs
    refs = self.reference_table(plan, pairs)
    if jax.process_index() == 0:
      os.makedirs(self.workdir, exist_ok=True)
      tmp = path + ".tmp.npz"
      np.savez(tmp, refs=refs, fingerprint=np.asarray(fingerprint))
      os.replace(tmp, path)
    return refs

  def reference_table(self, plan, pairs) -> np.ndarray:
    """refs_N2 float32: the starting model's (chosen, rejected) log-probs of every pair,
    computed on the run's mesh as the training step computes: params by the layout, rows
    over the batch axes. Every process passes the same rows and gets every result."""
    mesh, layout = plan.mesh, plan.layout
    params = self.place(self.initial_params(plan), mesh, layout)  # the start: the reference
    rows_sh = batch_sharding(mesh)
    score = jax.jit(functools.partial(forward_logps, self.graphdef),
                    in_shardings=(jax.tree.map(lambda x: x.sharding, params), None),
                    out_shardings=NamedSharding(mesh, PartitionSpec()))  # read by all
    rows = int(self.config.batch_size)
    refs = []
    with (parallel.axis_rules(layout.rules), jax.set_mesh(mesh),
          parallel.pipeline_schedule(plan.pipeline)):
      for i in range(0, len(pairs), rows):
        chunk = list(pairs[i:i + rows])
        n = len(chunk)
        chunk += [chunk[-1]] * (rows - n)  # one compiled shape
        batch = {k: jax.make_array_from_callback(v.shape, field_sharding(rows_sh, v.ndim),
                                                 lambda index, v=v: v[index])
                 for k, v in pair_batch(chunk, self.config.seq_len).items()}
        logps_2B = np.asarray(score(params, batch))
        refs.append(np.stack([logps_2B[:rows], logps_2B[rows:]], axis=1)[:n])
    return np.concatenate(refs).astype(np.float32)

  # --- loss and metrics ---

  def pair_terms(self, trainable, frozen, batch):
    joined = join_pairs(batch)
    logps_2B, stats = sequence_logps(self.policy(trainable, frozen), joined, with_stats=True)
    chosen_B, rejected_B = split_pairs(logps_2B)
    ref_chosen_B, ref_rejected_B = self.reference_logps(frozen, batch, joined)
    d = self.align.dpo
    lengths = split_pairs(response_lengths(joined)) if d.loss_type == "ipo" else (None, None)
    loss_B, metrics = dpo_loss(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B,
                               beta=d.beta, loss_type=d.loss_type,
                               label_smoothing=d.label_smoothing,
                               reference_free=d.reference_free, chosen_lengths_B=lengths[0],
                               rejected_lengths_B=lengths[1])
    metrics = self.with_router_stats(metrics, stats)
    return loss_B, metrics, (chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)

  def loss(self, trainable, frozen, batch):
    loss_B, metrics, _ = self.pair_terms(trainable, frozen, batch)
    return jnp.mean(loss_B), metrics

  def eval_sums(self, trainable, frozen, batch):
    loss_B, _, (c_B, r_B, ref_c_B, ref_r_B) = self.pair_terms(trainable, frozen, batch)
    beta = self.align.dpo.beta
    zero = jnp.zeros_like(c_B)
    rc_B = beta * (c_B - (zero if ref_c_B is None else ref_c_B))
    rr_B = beta * (r_B - (zero if ref_r_B is None else ref_r_B))
    per_pair = {"loss": loss_B, "rewards/chosen": rc_B, "rewards/rejected": rr_B,
                "rewards/margins": rc_B - rr_B, "rewards/accuracies": rc_B > rr_B,
                "logps/chosen": c_B, "logps/rejected": r_B,
                # The policy's own preference, meaningful before training too (where the
                # implicit reward is 0 for every pair).
                "policy/prefers_chosen": c_B > r_B}
    return pair_sums(per_pair, pair_valid(batch))

  def finish_eval(self, out, n):
    """Adds the 95% Wilson interval of the held-out implicit-reward accuracy over n pairs."""
    low, high = wilson_interval(out["val_rewards/accuracies"] * n, n)
    out["val_rewards/accuracies_ci_low"], out["val_rewards/accuracies_ci_high"] = low, high
    return out
