"""OnPolicyTask, what PPO (align/ppo.py) and GRPO (align/grpo.py) share: prompt data,
rollouts in `prepare` (align/rollout.py), several updates a step, evaluation by sampling.

One or many processes (jax.distributed), the same run: a step's prompts are one global batch
and each process samples, on its own devices (parallel.process_mesh), and scores its
contiguous share of the rows, with the seeds of their global row indices. Everything after
is computed over the global batch on the run's mesh, by jitted functions with explicit
shardings: the old and reference log-probs, values and advantages (`experience`: PPO's
whitening and KL statistics are global), the updates, and the evaluation's sums. A GRPO
group stays within one process (its G rows are consecutive), so group normalisation on the
host is exact.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

import parallel
from align import datasets as ds_lib
from align.logprobs import response_mask
from align.rewards import make_scorer
from align.rollout import (EVAL, TRAIN, Rollout, Sampler, completion_logps, load_prompt_split,
                           policy_forward, prompt_dataset, row_seeds, sample_rollout)
from align.tasks import AlignTask, masked_sum
from models import ConfigError
from train import data as data_lib
from train import step as step_lib
from train.optimizer import make_optimizer
from train.task import batch_sharding, field_sharding

VALUE = "value_head"  # PPO's value head, kept beside the LM's params (align/ppo.py)


def lm_only(params):
  """`params` without a value head: the LM's own params (what Engine, the reference and an
  exported model take)."""
  if VALUE not in params:
    return params
  return nnx.State({k: v for k, v in dict(params).items() if k != VALUE})


def update_step(state, batch, frozen, *, loss_fn, tx, schedule, epochs: int, minibatches: int,
                seed: int, inject_nan: bool = False):
  """epochs x minibatches optimizer updates on one rollout batch, as one loop step: each
  epoch visits the rows in a fresh order (from (seed, step): resume is exact) split into
  `minibatches` equal parts. The state's step advances by 1; the optimizer's own count by
  epochs x minibatches (the task's optimizer schedule is stretched to match). Metrics: the
  mean over the updates (`skipped`: the max)."""
  rows = next(iter(batch.values())).shape[0]
  key = jax.random.fold_in(jax.random.key(seed), state["step"])
  # [epochs * minibatches, rows / minibatches]: the rows of each update, in order
  order = jnp.stack([jax.random.permutation(jax.random.fold_in(key, e), rows)
                     for e in range(epochs)]).reshape(epochs * minibatches, -1)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def one(st, idx):
    mb = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)
    (loss, aux), grads = grad_fn(st["params"], frozen, mb)
    st, m = step_lib.apply_gradients(st, grads, loss, tx=tx, schedule=schedule,
                                     inject_nan=inject_nan)
    return st, {**aux, **m}

  new, per_update = jax.lax.scan(one, state, order)
  metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), per_update)
  metrics["skipped"] = jnp.max(per_update["skipped"])
  metrics["lr"] = schedule(state["step"] * epochs * minibatches)
  return dict(new, step=state["step"] + 1), metrics


class OnPolicyTask(AlignTask):
  """Prompt data, rollouts in `prepare`, several updates a step, evaluation by sampling.
  Subclasses set `section` (config.align.<section>), write `experience` and `loss`.

  The reference (`uses_reference`): the frozen base under LoRA, else a frozen copy of the
  starting LM. Evaluation samples one completion per validation prompt (fixed seeds) and
  reports val_reward, val_length (tokens), val_kl (summed log pi - log pi_ref), means over
  every process's prompts.
  """

  pairs = False
  section = ""

  def __init__(self, config, workdir):
    super().__init__(config, workdir)
    self.rl = self.align[self.section]
    self.group = self.group_size()
    new, rows = int(self.rl.max_new_tokens), int(config.batch_size)
    if not 0 < new < config.seq_len:
      raise ConfigError(f"align.{self.section}.max_new_tokens={new} must be in "
                        f"[1, seq_len={config.seq_len})")
    self.epochs, self.minibatches = int(self.rl.epochs), int(self.rl.minibatches)
    self.updates = self.epochs * self.minibatches
    if self.epochs < 1 or self.minibatches < 1 or rows % self.minibatches or rows % self.group:
      raise ConfigError(f"batch_size={rows} must split into align.{self.section}.minibatches="
                        f"{self.minibatches} (and groups of {self.group}); epochs >= 1")
    if (rows // self.group) % jax.process_count():
      raise ConfigError(f"batch_size={rows} makes {rows // self.group} prompts a step (groups "
                        f"of {self.group}), which must split evenly over "
                        f"{jax.process_count()} processes")
    if self.updates > 1 and config.grad_accum != 1:
      raise ConfigError("several updates a step (epochs x minibatches > 1) need grad_accum=1")
    self.max_prompt_len = config.seq_len - new
    self.temperature = float(self.rl.temperature)

  def group_size(self) -> int:
    return 1

  @property
  def uses_reference(self) -> bool:
    return True

  # --- data ---

  def datasets(self, plan) -> dict:
    c = self.config
    self.tokenizer = plan.tokenizer
    self.scorer = make_scorer(self.rl.reward, plan.tokenizer)
    data_cfg = {**self.data_cfg(), "text_key": c.data.text_key,
                "doc_separator": c.data.doc_separator}
    out = {}
    for split in data_lib.SPLITS:
      prompts, report = load_prompt_split(data_cfg, plan.tokenizer, split, self.max_prompt_len,
                                          self.rl.prompts)
      ds_lib.write_report(self.workdir, split, report)
      if jax.process_index() == 0:
        print(f"meshlm {self.name}: {split} prompts {report.as_dict()}", flush=True)
      if split == "train" or report.total:
        report.check(self.align.max_skipped_fraction)
      out[split] = prompt_dataset(prompts, batch_size=c.batch_size // self.group,
                                  max_prompt_len=self.max_prompt_len, split=split, seed=c.seed,
                                  process_index=jax.process_index(),
                                  process_count=jax.process_count())
    return out

  # --- params ---

  def make_optimizer(self, config):
    if self.updates == 1:
      return super().make_optimizer(config)
    # several updates a step: the schedule counts optimizer updates, so stretch it to match
    opt = ConfigDict(config.optimizer.to_dict())
    opt.warmup_steps = int(opt.warmup_steps) * self.updates
    return make_optimizer(opt, config.steps * self.updates)

  def init_state(self, plan, tx, mesh, layout):
    out = super().init_state(plan, tx, mesh, layout)
    self.batch_sh = batch_sharding(mesh)
    self.local_mesh = parallel.process_mesh(mesh)  # where this process samples its rows
    self.sampler = Sampler(self.graphdef, plan.tokenizer, self.config.seq_len,
                           self.config.batch_size // jax.process_count())
    lm_shardings = lm_only(self.frozen_shardings["model"] if self.rank  # LoRA: the base's
                           else self.param_shardings)
    self._lm_params = jax.jit(self.policy_params,
                              in_shardings=(self.param_shardings, self.frozen_shardings),
                              out_shardings=lm_shardings)
    return out

  def policy_params(self, trainable, frozen):
    return lm_only(super().policy_params(trainable, frozen))

  def more_frozen(self, plan, params, mesh, layout):
    if self.rank or not self.uses_reference:
      return {}
    return {"ref": jax.tree.map(jnp.copy, lm_only(params))}  # full fine-tuning: the start

  def ref_params(self, frozen):
    return lm_only(frozen["model"]) if self.rank else frozen["ref"]

  def logps(self, lm_params, batch, mask_BT):
    """token logps_BT of the sampled distribution under the LM `lm_params`."""
    _, logits_BTV = policy_forward(nnx.merge(self.graphdef, lm_params), batch, self.temperature)
    return completion_logps(logits_BTV, batch, mask_BT)

  def jit_on_mesh(self, fn, out_shardings, args: int = 1):
    """fn(trainable, frozen, batch, *more) jitted on the run's mesh: params and frozen as the
    state holds them, the global batch (and `args` - 1 more arguments) as given (to_global
    lays a batch out)."""
    return jax.jit(fn, in_shardings=(self.param_shardings, self.frozen_shardings) +
                   (None,) * args, out_shardings=out_shardings)

  def field_sharding(self, ndim: int) -> NamedSharding:
    """Where a global batch field of rank `ndim` lives (a scalar: replicated)."""
    return field_sharding(self.batch_sh, ndim)

  # --- steps ---

  def step_fn(self, tx, schedule, shardings, frozen_shardings, batch_sh, inject_nan=False):
    if self.updates == 1:  # one update a rollout: the shared objective step (grad_accum too)
      return super().step_fn(tx, schedule, shardings, frozen_shardings, batch_sh, inject_nan)
    step = functools.partial(update_step, loss_fn=self.loss, tx=tx, schedule=schedule,
                             epochs=self.epochs, minibatches=self.minibatches,
                             seed=self.config.seed, inject_nan=inject_nan)
    return jax.jit(step, in_shardings=(shardings, None, frozen_shardings),
                   out_shardings=(shardings, None), donate_argnums=0)

  def rollout(self, trainable, frozen, prompt_batch, seeds, repeat: int = 1) -> Rollout:
    """This process's rows, sampled on its own devices: the current LM's params are moved
    onto them (every process calls this together), the Engine runs there alone."""
    params = parallel.to_process_mesh(self._lm_params(trainable, frozen), self.local_mesh)
    with jax.set_mesh(self.local_mesh):
      return sample_rollout(self.sampler, params, prompt_batch, seeds,
                            seq_len=self.config.seq_len, temperature=self.temperature,
                            max_new_tokens=int(self.rl.max_new_tokens), repeat=repeat)

  def score(self, rollout: Rollout) -> np.ndarray:
    """scores_B float32 of this process's rows (a reward model runs on its own devices)."""
    with jax.set_mesh(self.local_mesh):
      return np.asarray(self.scorer(rollout), np.float32)

  def seeds(self, step: int, rows: int, namespace: int = TRAIN) -> list[int]:
    """The sampling seeds of this process's `rows` rows: those of their global indices."""
    return row_seeds(self.config.seed, step, rows, namespace, start=jax.process_index() * rows)

  def prepare(self, state, frozen, batch, step: int) -> dict:
    """The step's batch: completions sampled from the current policy, scored, with the
    subclass's training fields."""
    trainable = state["params"]
    rows = self.config.batch_size // jax.process_count()
    rollout = self.rollout(trainable, frozen, batch, self.seeds(step, rows), repeat=self.group)
    return self.experience(trainable, frozen, rollout, self.score(rollout), step)

  def experience(self, trainable, frozen, rollout: Rollout, scores_B, step: int) -> dict:
    """The training batch: this process's rows and fields, and fields computed on the mesh
    over the global batch (global arrays, which the loop's to_global keeps)."""
    raise NotImplementedError

  # --- evaluation ---

  def evaluate(self, params, frozen, batches, batch_sh) -> dict:
    rows = (self.eval_rows(params, frozen, batch, i) for i, batch in enumerate(batches))
    return super().evaluate(params, frozen, rows, batch_sh)  # sums over the global batches

  def eval_rows(self, params, frozen, prompt_batch, i: int) -> dict:
    """Validation batch i's rollout (one completion a prompt), scored: this process's rows."""
    rollout = self.rollout(params, frozen, prompt_batch,
                           self.seeds(i, len(prompt_batch["prompt_len"]), EVAL))
    return {**rollout.batch, "scores": self.score(rollout), "valid": rollout.valid_B}

  def eval_sums(self, trainable, frozen, batch) -> dict:
    valid_B = batch["valid"]
    mask_BT = response_mask(batch)
    out = {"reward": masked_sum(batch["scores"], valid_B),
           "length": masked_sum(jnp.sum(mask_BT, axis=-1), valid_B),
           "count": jnp.sum(valid_B)}
    if self.uses_reference:
      kl_B = jnp.sum(self.logps(self.policy_params(trainable, frozen), batch, mask_BT) -
                     self.logps(self.ref_params(frozen), batch, mask_BT), axis=-1)
      out["kl"] = masked_sum(kl_B, valid_B)
    return out
