"""A distilled student as SmolLM2-135M-Instruct's speculative draft: acceptance rate of the
KD student against the hard-label student, side by side, plus their held-out metrics.

    python benchmarks/distill_speculative.py --json [--kd runs/distill_kd]
        [--hard runs/distill_hard] [--prompts 8] [--max_tokens 48]

Workload (fixed by rule): the first N held-out hh-rlhf helpful-base conversations of the
distillation config's split (10% of conversation openings), their first user turn in
SmolLM2's chat template; greedy decoding (acceptance is then the share of drafts equal to
the target's greedy token), gamma 4, stop at EOS, batch 1. The outputs must equal plain
greedy decoding (equal_output). Held-out top-1 agreement and perplexity come from each
workdir's last metrics.jsonl record (its final evaluation over the whole held-out split).

One JSON document goes to stdout; progress text goes to stderr.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import cpu_count, log  # noqa: E402

GAMMA = 4


def _prompts(tokenizer, n):
  from align.data import parse_hh, read_records, DataReport
  from align.datasets import split_records
  from experiments.distill_smollm2 import get_config
  c = get_config()
  held_out = split_records(read_records(c.data.path, DataReport()), "validation",
                           c.data.val_fraction)
  out = []
  for where, record in held_out:
    first = parse_hh(record["chosen"])[0]["content"]
    out.append((where.rsplit(":", 1)[1], tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": first}]), add_bos=False)))
    if len(out) == n:
      break
  return out


def _last_eval(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if "val_top1_agreement" in line]
  r = rows[-1]
  return dict(step=r["step"], val_top1_agreement=round(r["val_top1_agreement"], 4),
              val_ppl=round(r["val_ppl"], 3), val_kl=round(r["val_kl"], 4),
              val_tokens=r["val_count"])


def run(students: dict, n_prompts: int, max_tokens: int) -> dict:
  import jax

  import models
  from benchmarks.decode_models import smollm_path
  from infer import Engine, SamplingParams
  from infer.speculative import ModelDraft, SpeculativeDecoder
  from train.workdir import load_trained

  target, tok = models.load_pretrained(smollm_path())
  prompts = _prompts(tok, n_prompts)
  longest = max(len(ids) for _, ids in prompts) + max_tokens + GAMMA + 1
  max_seq_len = 1 << max(8, (longest - 1).bit_length())
  params = SamplingParams(max_tokens=max_tokens)
  plain = [Engine(target, tok, max_seq_len=max_seq_len, max_batch=1).generate(ids, params)[0]
           .token_ids for _, ids in prompts]
  result = {}
  for name, workdir in students.items():
    student, _, step = load_trained(workdir)
    decoder = SpeculativeDecoder(target, ModelDraft(student), gamma=GAMMA,
                                 max_seq_len=max_seq_len, eos_id=tok.eos_id)
    proposed = accepted = passes = 0
    outputs = []
    for pid, ids in prompts:
      out, stats = decoder.generate(ids, params)
      outputs.append(out)
      proposed, accepted = proposed + sum(stats.proposed_Y), accepted + sum(stats.accepted_Y)
      passes += stats.target_passes
      log(f"{name} prompt {pid}: {len(out)} tokens, acceptance {stats.acceptance_rate()}")
    result[name] = dict(workdir=os.path.relpath(workdir, REPO), params=student.cfg.num_params(),
                        checkpoint_step=step, proposed=proposed, accepted=accepted,
                        acceptance_rate=round(accepted / max(proposed, 1), 4),
                        tokens_per_target_pass=round(sum(map(len, outputs)) / max(passes, 1), 3),
                        equal_output=outputs == plain, **_last_eval(workdir))
  names = list(result)
  return dict(
      teacher=dict(model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
                   params=target.cfg.num_params()),
      students=result,
      kd_beats_hard=({k: result["kd"][k] > result["hard"][k] if k != "val_ppl" else
                      result["kd"][k] < result["hard"][k]
                      for k in ("val_top1_agreement", "val_ppl", "acceptance_rate")}
                     if names == ["kd", "hard"] else None),
      workload=dict(prompts=[dict(id=pid, prompt_tokens=len(ids)) for pid, ids in prompts],
                    max_tokens=max_tokens, gamma=GAMMA, decoding="greedy, stop at EOS, batch 1"),
      env=dict(jax=jax.__version__, backend=jax.default_backend(), cpu_count=cpu_count()))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document")
  parser.add_argument("--kd", default=os.path.join(REPO, "runs", "distill_kd"))
  parser.add_argument("--hard", default=os.path.join(REPO, "runs", "distill_hard"))
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--max_tokens", type=int, default=48)
  args = parser.parse_args()
  students = {k: v for k, v in (("kd", args.kd), ("hard", args.hard)) if os.path.isdir(v)}
  if not students:
    raise SystemExit(f"no student workdir found ({args.kd}, {args.hard}): run the commands "
                     "in experiments/distill_smollm2.py first")
  result = run(students, args.prompts, args.max_tokens)
  print(json.dumps(result, indent=2) if args.json else
        {k: v["acceptance_rate"] for k, v in result["students"].items()})


if __name__ == "__main__":
  main()
