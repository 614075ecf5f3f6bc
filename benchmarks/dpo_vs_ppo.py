"""DPO (several beta) vs PPO (several kl_coef): reward against KL(pi || pi_ref), and compute.

    python benchmarks/dpo_vs_ppo.py --json > /tmp/dpo_vs_ppo.json   # ~7 min on 2 busy CPU cores
    python benchmarks/dpo_vs_ppo.py --quick --json                  # tiny smoke run

Setup (experiments/dpo_vs_ppo.py): pi_ref is a tiny Tiny-Shakespeare LM; a prompt is the first
words of a line; the reward is "letter:e" (share of 'e' characters of the completion).
  DPO  two pi_ref samples (temperature 1) per train prompt, the higher reward chosen (ties
       dropped), given to DPOTask as token rows: exactly PPO's prompt ids and sampled ids
  PPO  PPOTask on the same train prompts, temperature 1, fixed kl_coef
Every checkpoint of every run (and pi_ref) is evaluated the same way: EVAL_SAMPLES completions
of each held-out prompt with fixed seeds (the same for every policy), temperature 1:
  reward  mean score;  kl  mean of sum_t log pi - log pi_ref over the completion tokens
Compute, F = forward FLOPs per token (train/flops.py / 3): 3F per trained token, F per
sampled or scored token. PPO a step: sample + policy and ref forwards + epochs x train; DPO:
sampling the pairs + pi_ref's cached logps (once) + train. wall_s: startup, compile and step
time of the run (DPO: plus sampling its pairs); evaluation is not counted for either.

One JSON document goes to stdout (the markdown table in "table_md"); progress to stderr;
the plot to docs/img/dpo_vs_ppo.png when matplotlib is installed.
"""

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from align.dpo import DPOTask  # noqa: E402
from align.logprobs import sequence_logps  # noqa: E402
from align.ppo import PPOTask  # noqa: E402
from align.rewards import make_scorer  # noqa: E402
from align.rollout import EVAL, Sampler, row_seeds, sample_rollout  # noqa: E402
from benchmarks.common import cpu_count, log  # noqa: E402
from benchmarks.dpo_vs_ppo_analysis import analyse, plot, table  # noqa: E402
from experiments import dpo_vs_ppo as exp  # noqa: E402
from train import flops as flops_lib  # noqa: E402
from train.checkpoint import restore_params  # noqa: E402
from train.loop import train  # noqa: E402
from train.state import split_abstract_model  # noqa: E402
from train.workdir import load_model_config, load_tokenizer  # noqa: E402

PAIRS = 2  # seed namespace of DPO's pair sampling (rollout.py uses 0: train, 1: eval)
PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img",
                    "dpo_vs_ppo.png")


def sweep(quick: bool) -> dict:
  s = {k.lower(): getattr(exp, k) for k in (
      "REWARD", "PROMPT_WORDS", "TRAIN_PROMPTS", "EVAL_PROMPTS", "EVAL_SAMPLES", "MAX_NEW_TOKENS",
      "DPO_BETAS", "PPO_KL_COEFS", "DPO_STEPS", "DPO_EVAL_EVERY", "PPO_STEPS", "PPO_EVAL_EVERY")}
  s["ref_steps"] = exp.get_config("ref").steps
  if quick:  # the whole pipeline in about a minute
    s.update(train_prompts=24, eval_prompts=8, max_new_tokens=6, dpo_betas=(0.1, 1.0),
             ppo_kl_coefs=(0.01,), dpo_steps=4, dpo_eval_every=2, ppo_steps=4, ppo_eval_every=2,
             ref_steps=10)
  return s


def make_prompts(path: str, s: dict, seed: int = 0) -> tuple[list[str], list[str]]:
  """(train, eval) prompts: the first PROMPT_WORDS words of distinct, shuffled lines."""
  with open(path) as f:
    lines = [ln.split() for ln in f]
  prompts = sorted({" ".join(w[:s["prompt_words"]]) for w in lines
                    if len(w) >= s["prompt_words"] + 2})
  random.Random(seed).shuffle(prompts)
  n, m = s["train_prompts"], s["eval_prompts"]
  if len(prompts) < n + m:
    raise ValueError(f"{path}: {len(prompts)} prompts, need {n + m}")
  return prompts[:n], prompts[n:n + m]


def write_lines(path: str, lines: list[str]) -> str:
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  return path


class Policies:
  """pi_ref, a sampler and the KL scorer shared by DPO's data and every evaluation."""

  def __init__(self, ref_dir: str, s: dict, seq_len: int, rows: int):
    self.model_cfg = load_model_config(ref_dir)
    self.tokenizer = load_tokenizer(ref_dir)
    self.graphdef, self.abstract = split_abstract_model(self.model_cfg)
    self.ref = self.params(ref_dir)
    self.s, self.seq_len, self.rows = s, seq_len, rows
    self.max_prompt_len = seq_len - s["max_new_tokens"]
    self.sampler = Sampler(self.graphdef, self.tokenizer, seq_len, rows)
    self.scorer = make_scorer(s["reward"])
    logps = lambda p, b: sequence_logps(nnx.merge(self.graphdef, p), b)
    self._kl = jax.jit(lambda p, ref, b: logps(p, b) - logps(ref, b))
    self._logps = jax.jit(logps)
    # Forward FLOPs per token: the loop's 6N-style training count / 3.
    self.fwd_flops = flops_lib.train_flops_per_token(self.model_cfg, seq_len) / 3.0

  def params(self, workdir: str, step: int | None = None):
    return restore_params(workdir, self.abstract, step)[0]

  def encode(self, texts: list[str]) -> list[np.ndarray]:
    """Prompt ids as align/rollout.load_prompt_split makes "text" prompts."""
    return [np.asarray(self.tokenizer.encode(t.strip())[:self.max_prompt_len], np.int32)
            for t in texts]

  def sample(self, params, prompts: list[np.ndarray], seeds: list[int]):
    """A Rollout of len(seeds) // len(prompts) completions per prompt (rows = self.rows)."""
    repeat = len(seeds) // len(prompts)
    ids_BP = np.zeros((len(prompts), self.max_prompt_len), np.int32)
    for b, p in enumerate(prompts):
      ids_BP[b, :len(p)] = p
    batch = {"prompt_ids": ids_BP, "prompt_len": np.asarray([len(p) for p in prompts], np.int32)}
    return sample_rollout(self.sampler, params, batch, seeds, seq_len=self.seq_len,
                          temperature=1.0, max_new_tokens=self.s["max_new_tokens"], repeat=repeat)

  def evaluate(self, params, prompts: list[np.ndarray]) -> dict:
    """Mean reward and KL (with standard errors) over fixed-seed samples of `params`."""
    k = self.s["eval_samples"]
    scores, kls, lengths = [], [], []
    for i in range(0, len(prompts), self.rows // k):
      chunk = prompts[i:i + self.rows // k]
      r = self.sample(params, chunk, row_seeds(0, i, len(chunk) * k, EVAL))
      scores += list(self.scorer(r))
      kls += list(np.asarray(self._kl(params, self.ref, r.batch)))
      lengths += list(r.batch["loss_mask"].sum(-1))
    se = lambda x: float(np.std(x) / np.sqrt(len(x)))
    return {"reward": float(np.mean(scores)), "reward_se": se(scores), "kl": float(np.mean(kls)),
            "kl_se": se(kls), "length": float(np.mean(lengths))}


def row_example(batch: dict, r: int):
  """(ids_N, mask_N) of rollout row r: prompt + sampled ids, mask 1 on the sampled ones."""
  n = int((batch["segment_ids"][r] > 0).sum())
  ids = np.append(batch["inputs"][r, :n], batch["targets"][r, n - 1]).astype(np.int32)
  return ids, np.append(0, batch["loss_mask"][r, :n]).astype(np.int32)


def make_pairs(pol: Policies, prompts: list[np.ndarray]) -> tuple[list, dict]:
  """DPO pairs from two pi_ref samples per prompt: (chosen, rejected) rows, ties dropped."""
  pairs, ties, tokens = [], 0, 0
  per = pol.rows // 2
  for i in range(0, len(prompts), per):
    chunk = prompts[i:i + per]
    r = pol.sample(pol.ref, chunk, row_seeds(0, i, 2 * len(chunk), PAIRS))
    scores = pol.scorer(r)
    tokens += int((r.batch["segment_ids"] > 0).sum())
    for b in range(len(chunk)):
      a, c = 2 * b, 2 * b + 1
      if scores[a] == scores[c]:
        ties += 1
        continue
      hi, lo = (a, c) if scores[a] > scores[c] else (c, a)
      pairs.append((row_example(r.batch, hi), row_example(r.batch, lo)))
  return pairs, {"pairs": len(pairs), "ties_dropped": ties, "sampled_tokens": tokens}


class PairsDPOTask(DPOTask):
  """DPOTask on token-level pairs given in memory (no JSONL round trip through the text)."""

  def __init__(self, config, workdir, pairs: dict):
    super().__init__(config, workdir)
    self._pairs = pairs

  def load_split(self, plan, split):
    return self._pairs[split]


def run_config(kind: str, s: dict, ref_dir: str, train_file: str, eval_file: str):
  c = exp.get_config(kind)
  c.init_from = ref_dir
  c.data.path, c.data.validation_path = train_file, eval_file
  if kind == "dpo":
    c.steps, c.checkpoint_every = s["dpo_steps"], s["dpo_eval_every"]
  else:
    c.steps, c.checkpoint_every = s["ppo_steps"], s["ppo_eval_every"]
    c.align.ppo.max_new_tokens, c.align.ppo.reward = s["max_new_tokens"], s["reward"]
    c.log_every = 1  # every step's response_length: its token count
  c.keep_checkpoint_every, c.eval_every = c.checkpoint_every, c.steps
  return c


def timed_train(config, workdir, task) -> dict:
  """Runs the loop; seconds of startup + compile + steps (not eval or checkpoints)."""
  train(config, workdir, task=task)
  with open(os.path.join(workdir, "goodput.json")) as f:
    sec = json.load(f)["seconds"]
  return {"overhead_s": sec["startup"] + sec["compile"], "train_s": sec["train"]}


def curve(pol, workdir, steps, every, eval_prompts, flops_at, wall_at) -> list[dict]:
  out = []
  for step in range(every, steps + 1, every):
    out.append({"step": step, **pol.evaluate(pol.params(workdir, step), eval_prompts),
                "flops": flops_at(step), "wall_s": wall_at(step)})
  return out


def run(args) -> dict:
  s = sweep(args.quick)
  root = os.path.abspath(args.workdir)
  if args.fresh and os.path.isdir(root):
    shutil.rmtree(root)
  os.makedirs(root, exist_ok=True)
  started = time.perf_counter()
  ref_dir, ref_cfg = os.path.join(root, "ref"), exp.get_config("ref")
  ref_cfg.steps = s["ref_steps"]
  t = time.perf_counter()
  train(ref_cfg, ref_dir)  # resumes: a finished ref is reused
  ref_s = time.perf_counter() - t
  train_txt, eval_txt = make_prompts(exp.SHAKESPEARE, s)
  train_file = write_lines(os.path.join(root, "prompts_train.txt"), train_txt)
  eval_file = write_lines(os.path.join(root, "prompts_eval.txt"), eval_txt)
  rows = 2 * min(s["eval_prompts"], s["train_prompts"] // 2)  # one compiled sampling shape
  pol = Policies(ref_dir, s, ref_cfg.seq_len, rows)
  eval_ids, train_ids = pol.encode(eval_txt), pol.encode(train_txt)
  log(f"dpo_vs_ppo: pi_ref ({ref_s:.0f}s); evaluating it")
  ref_point = {"step": 0, **pol.evaluate(pol.ref, eval_ids), "flops": 0.0, "wall_s": 0.0}
  F = pol.fwd_flops

  t = time.perf_counter()
  pairs, pair_info = make_pairs(pol, train_ids)
  n_val = max(2, len(pairs) // 32)
  split = {"train": pairs[:-n_val], "validation": pairs[-n_val:]}
  pair_tokens = [len(c[0]) - 1 + len(r[0]) - 1 for c, r in split["train"]]
  # Sampling every prompt twice, then pi_ref's logps of every kept pair (cached, once).
  dpo_data_flops = F * (pair_info["sampled_tokens"] + sum(len(c[0]) + len(r[0]) - 2
                                                          for c, r in pairs))
  dpo_data_s = time.perf_counter() - t
  pair_info.update(data_s=dpo_data_s, data_flops=dpo_data_flops,
                   mean_pair_tokens=float(np.mean(pair_tokens)))
  log(f"dpo_vs_ppo: {pair_info}")

  runs = []
  for beta in s["dpo_betas"]:
    wd = os.path.join(root, f"dpo_beta{beta}")
    shutil.rmtree(wd, ignore_errors=True)
    c = run_config("dpo", s, ref_dir, train_file, eval_file)
    c.align.dpo.beta = beta
    log(f"dpo_vs_ppo: DPO beta={beta}")
    tm = timed_train(c, wd, PairsDPOTask(c, wd, split))
    step_flops = 3 * F * c.batch_size * pair_info["mean_pair_tokens"]
    runs.append({"method": "dpo", "coef": beta, "points": [{**ref_point, "flops": dpo_data_flops,
                                                            "wall_s": dpo_data_s}] + curve(
        pol, wd, c.steps, c.checkpoint_every, eval_ids,
        lambda k: dpo_data_flops + k * step_flops,
        lambda k, tm=tm, n=c.steps: dpo_data_s + tm["overhead_s"] + tm["train_s"] * k / n)})
    log(f"dpo_vs_ppo: {runs[-1]['points'][-1]}")

  prompt_len = float(np.mean([len(p) for p in train_ids]))
  for coef in s["ppo_kl_coefs"]:
    wd = os.path.join(root, f"ppo_kl{coef}")
    shutil.rmtree(wd, ignore_errors=True)
    c = run_config("ppo", s, ref_dir, train_file, eval_file)
    c.align.ppo.kl_coef = coef
    log(f"dpo_vs_ppo: PPO kl_coef={coef}")
    tm = timed_train(c, wd, PPOTask(c, wd))
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      lengths = {r["step"]: r["response_length"] for r in map(json.loads, f)
                 if "response_length" in r}
    # A step: sample (F) + policy and ref forwards (2F) + epochs x train (3F) per token.
    per_token = F * (3 + 3 * c.align.ppo.epochs)
    cum = np.cumsum([0.0] + [per_token * c.batch_size * (prompt_len + lengths[k])
                             for k in range(1, c.steps + 1)])
    runs.append({"method": "ppo", "coef": coef, "points": [ref_point] + curve(
        pol, wd, c.steps, c.checkpoint_every, eval_ids, lambda k, cum=cum: float(cum[k]),
        lambda k, tm=tm, n=c.steps: tm["overhead_s"] + tm["train_s"] * k / n)})
    log(f"dpo_vs_ppo: {runs[-1]['points'][-1]}")

  summary = analyse(runs, ref_point)
  doc = {"sweep": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
         "model": {"params": pol.model_cfg.num_params(), "fwd_flops_per_token": F,
                   "ref_steps": ref_cfg.steps, "ref_train_s": ref_s},
         "ppo_config": run_config("ppo", s, ref_dir, train_file, eval_file).align.ppo.to_dict(),
         "dpo_config": run_config("dpo", s, ref_dir, train_file, eval_file).align.dpo.to_dict(),
         "dpo_data": pair_info, "ref": ref_point, "runs": runs, **summary,
         "env": {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": cpu_count(),
                 "python": platform.python_version(), "loadavg": os.getloadavg(),
                 "total_s": time.perf_counter() - started}}
  doc["table_md"] = table(doc)
  if args.plot:
    doc["plot"] = plot(doc, args.plot)
  return doc


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
  ap.add_argument("--json", action="store_true", help="print only the JSON document to stdout")
  ap.add_argument("--workdir", default=None, help="default runs/dpo_vs_ppo (quick: a temp dir)")
  ap.add_argument("--fresh", action="store_true", help="retrain pi_ref too")
  ap.add_argument("--plot", default=None, help=f"PNG path (default {PLOT}; quick: none)")
  args = ap.parse_args(argv)
  if args.workdir is None:
    import tempfile
    args.workdir = tempfile.mkdtemp(prefix="dpo_vs_ppo_") if args.quick else "runs/dpo_vs_ppo"
  if args.plot is None and not args.quick:
    args.plot = PLOT
  with contextlib.redirect_stdout(sys.stderr):  # the loop's log; stdout is for the JSON
    doc = run(args)
  log(doc["table_md"])
  print(json.dumps(doc, indent=1 if args.json else None))


if __name__ == "__main__":
  main()
