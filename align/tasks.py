"""Alignment runs on the shared training loop (train/loop.py): a Task each for SFT, reward
models, DPO and distillation. They differ only in their data, their loss and what they
hold frozen; sharding, checkpoints, resume, preemption, anomaly handling, the watchdog and
metrics are the loop's.

Params. `trainable` (the train state's params, what the optimizer sees) and `frozen` (read,
never updated, never given a gradient):
  full fine-tuning   trainable: the module's params, laid out as a pretraining checkpoint's
                     (so the workdir loads like any other); frozen: the DPO reference
                     {"ref"} (a copy of the starting params), the distillation teacher
  LoRA (align.lora_rank > 0)
                     trainable {"lora": adapters, "extra": the head, if any}; frozen
                     {"model": the base params}: the policy is base + LoRA and the DPO
                     reference is the base itself, one backbone shared by both.
Checkpoints hold the trainable state only; the frozen part is rebuilt from init_from.
"""

import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from align import datasets as ds_lib
from align.lora import init_lora, lora_shardings, merge_lora
from models import ConfigError
from models.registry import create_model
from train.optimizer import make_optimizer
from train.state import assemble_state, state_shardings
from train.step import ROUTER_STATS
from train.task import jit_objective_step, to_global
from train.workdir import MERGED, save_model

METHODS = ("sft", "rm", "dpo", "distill")


def wilson_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
  """95% Wilson score interval of a binomial proportion."""
  if n <= 0:
    return 0.0, 1.0
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  # At p = 0 or 1 the bound is exactly 0 or 1; rounding must not move it inside p.
  low = 0.0 if successes <= 0 else max(centre - half, 0.0)
  high = 1.0 if successes >= n else min(centre + half, 1.0)
  return low, high


class AlignTask:
  """What every alignment method shares; subclasses set `pairs` and write `loss`/`eval_sums`."""

  name = ""
  pairs = True  # preference pairs (chosen_*/rejected_* rows) or packed SFT rows
  trains_moe = False  # its loss hands the step an MoE policy's router statistics
  moe_cfg = None  # set by init_state for an MoE policy

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, os.path.abspath(workdir)
    self.align = config.align
    self.rank = int(self.align.lora_rank)
    self.validate()  # before the loop writes anything

  def validate(self) -> None:
    """Raises ConfigError naming a bad align.* key."""
    a = self.align
    if self.rank < 0 or a.lora_alpha <= 0:
      raise ConfigError(f"align.lora_rank={a.lora_rank} must be >= 0 and align.lora_alpha="
                        f"{a.lora_alpha} > 0")
    if not 0 <= a.max_skipped_fraction <= 1:
      raise ConfigError(f"align.max_skipped_fraction={a.max_skipped_fraction} must be in [0, 1]")

  # --- data ---

  def data_cfg(self) -> dict:
    d = self.config.data
    return {"path": d.path, "val_fraction": d.val_fraction, "validation_path": d.validation_path,
            "max_len": self.config.seq_len, "drop_turns": self.align.drop_turns,
            "decontam": d.decontam}

  def load_split(self, plan, split: str) -> list:
    load = ds_lib.load_pair_split if self.pairs else ds_lib.load_sft_split
    items, report = load(self.data_cfg(), plan.tokenizer, split)
    ds_lib.write_report(self.workdir, split, report)
    if jax.process_index() == 0:
      print(f"meshlm {self.name}: {split} data {report.as_dict()}", flush=True)
    if split == "train" or report.total:
      report.check(self.align.max_skipped_fraction)  # raises: never train on mostly garbage
    return items

  def datasets(self, plan) -> dict:
    c = self.config
    per_process = c.batch_size // jax.process_count()
    out = {}
    for split in ("train", "validation"):
      items = self.load_split(plan, split)
      kwargs = dict(batch_size=per_process, seq_len=c.seq_len, split=split, seed=c.seed,
                    process_index=jax.process_index(), process_count=jax.process_count())
      if self.pairs:
        out[split] = ds_lib.pair_dataset(items, ref_logps=self.cached_refs(plan, split, items),
                                         **kwargs)
      else:
        out[split] = ds_lib.sft_dataset(items, **kwargs)
    return out

  @property
  def tokens_per_step(self) -> int:
    """Token positions a step feeds the model (a pair is two rows)."""
    return self.config.batch_size * self.config.seq_len * (2 if self.pairs else 1)

  def cached_refs(self, plan, split, pairs):
    return None

  # --- params ---

  def make_optimizer(self, config):
    """(tx, schedule): AdamW as pretraining's (train/optimizer.py)."""
    return make_optimizer(config.optimizer, config.steps)

  def build_module(self, plan, rngs):
    """The nnx module trained (a Transformer; a RewardModel for `rm`)."""
    return create_model(plan.model_cfg, rngs)

  def initial_params(self, plan):
    """The module's starting params: init_from's where given, else freshly initialised."""
    module = self.build_module(plan, nnx.Rngs(self.config.seed))
    self.graphdef, params = nnx.split(module, nnx.Param)
    if plan.init_params is not None:
      params = self.with_pretrained(params, plan.init_params)
    return params

  def with_pretrained(self, params, pretrained):
    return pretrained

  def place(self, tree, mesh, layout):
    """device_put by the tree's logical axis names (parallel/ maps them to the mesh)."""
    return jax.device_put(tree, parallel.logical_shardings(tree, mesh, layout.rules))

  def init_state(self, plan, tx, mesh, layout):
    if plan.model_cfg.is_moe and not self.trains_moe:
      raise ConfigError(f"align task {self.name!r} does not train mixture-of-experts models yet: "
                        "its objective does not hand the step its router statistics (sft and "
                        "dpo do)")
    self.moe_cfg = plan.model_cfg if plan.model_cfg.is_moe else None
    params = self.place(self.initial_params(plan), mesh, layout)
    if self.rank:
      lora = init_lora(params, self.rank, jax.random.key(self.config.seed + 1),
                       tuple(t for t in self.align.lora_targets.split(",") if t))
      lora = jax.device_put(lora, lora_shardings(lora, mesh))
      trainable = {"lora": lora, "extra": self.extra_trainables(params)}
      frozen = {"model": params}
    else:
      trainable, frozen = params, {}
    frozen.update(self.more_frozen(plan, params, mesh, layout))
    assemble = lambda p: assemble_state(p, tx, self.config.seed)
    # Params by the layout's rules, optimizer state by its opt_rules (ZeRO-1), as pretraining.
    shardings = state_shardings(jax.eval_shape(assemble, trainable), mesh, layout)
    state = jax.jit(assemble, out_shardings=shardings)(trainable)
    self.param_shardings = shardings["params"]
    self.frozen_shardings = jax.tree.map(lambda x: x.sharding, frozen)
    self.mesh = mesh
    self._eval = None
    return state, shardings, frozen, self.frozen_shardings

  def finish(self, state, frozen, step: int, plan) -> None:
    """After the last step of a LoRA run of a decoder: WORKDIR/merged, base + adapters as a
    plain workdir (what `meshlm generate --model WORKDIR` and init_from then load)."""
    if not self.rank or self.name == "rm":
      return
    merged = self.policy_params(state["params"], frozen)
    save_model(os.path.join(self.workdir, MERGED), plan.model_cfg, plan.tokenizer, merged, step)

  def extra_trainables(self, params) -> dict:
    """Module params trained in full even under LoRA (a reward head)."""
    return {}

  def more_frozen(self, plan, params, mesh, layout) -> dict:
    return {}

  def policy_params(self, trainable, frozen):
    """The module's params as the step sees them: LoRA merged into the frozen base."""
    if not self.rank:
      return trainable
    merged = merge_lora(frozen["model"], trainable["lora"], self.align.lora_alpha, self.rank)
    if trainable["extra"]:
      merged = nnx.State({**dict(merged), **trainable["extra"]})
    return merged

  def policy(self, trainable, frozen):
    return nnx.merge(self.graphdef, self.policy_params(trainable, frozen))

  def eval_model(self, state, frozen):
    """The policy at `state` (LoRA merged), for the evaluation gate (align/evals/promote.py)."""
    if self.name == "rm":
      raise ValueError("eval_gate: a reward model does not generate; gate the policy instead")
    return self.policy(state["params"], frozen)

  # --- steps ---

  def loss(self, trainable, frozen, batch):
    raise NotImplementedError

  def loss_weight(self, batch):
    """How much a microbatch weighs in an accumulated step (None: microbatches equally, right
    for per-pair means); token-mean losses return their token count."""
    return None

  def step_fn(self, tx, schedule, shardings, frozen_shardings, batch_sh, inject_nan=False):
    return jit_objective_step(self.loss, tx, schedule, shardings, frozen_shardings, None,
                              self.config.grad_accum, inject_nan, weight_fn=self.loss_weight,
                              moe_cfg=self.moe_cfg)

  @staticmethod
  def with_router_stats(metrics: dict, stats) -> dict:
    """metrics carrying an MoE policy's router statistics to the step (ROUTER_STATS), whose
    losses it adds and whose balancing biases it moves where they are trained (a LoRA run
    keeps them frozen with the base); a dense policy's ({}) add nothing."""
    return {**metrics, ROUTER_STATS: stats} if stats else metrics

  def eval_sums(self, trainable, frozen, batch) -> dict:
    """Per-batch sums for `evaluate`, with "count" the number of examples they sum over."""
    raise NotImplementedError

  def evaluate(self, params, frozen, batches, batch_sh) -> dict:
    if self._eval is None:  # the batch as to_global lays it out; sums replicated
      self._eval = jax.jit(self.eval_sums, in_shardings=(self.param_shardings,
                                                         self.frozen_shardings, None))
    totals = {}
    for batch in batches:
      sums = jax.device_get(self._eval(params, frozen, to_global(batch, batch_sh)))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    n = totals.pop("count", 0.0)
    if n == 0:  # no held-out data (val_fraction 0): nothing to report
      return {"val_count": 0.0}
    out = {f"val_{k}": v / n for k, v in totals.items()}
    out["val_count"] = n
    return self.finish_eval(out, n)

  def finish_eval(self, out: dict, n: float) -> dict:
    return out


def masked_sum(x_B, valid_B):
  return jnp.sum(jnp.where(valid_B > 0, x_B, 0.0))


def pair_sums(metrics_B: dict, valid_B) -> dict:
  """{name: sum over real pairs} of per-pair metrics, plus the pair count."""
  out = {k: masked_sum(v.astype(jnp.float32), valid_B) for k, v in metrics_B.items()}
  out["count"] = jnp.sum(valid_B)
  return out
