"""Helpfulness: win rate against reference answers, and reference-based task completion.

- Win rate (AlpacaEval / MT-Bench style): the model answers each held-out instruction; a
  judge (any meshlm chat checkpoint, align/curate/judge.py) compares its answer with the
  reference answer, shown in both orders so position bias cancels. A win scores 1, a loss
  0, and a tie or a verdict the judge could not give (too little mass on " A"/" B") 0.5,
  so every row counts and n does not depend on the model; unparsable verdicts are
  counted in the metric's note. Without a judge (a model with no chat template and no
  --judge) the win rates are left out and the report says why. References: AlpacaEval's text-davinci-003 outputs (805
  instructions; AlpacaEval 1's reference model) and MT-Bench's GPT-4 first-turn reference
  answers (the 30 questions that have one).
- Task completion on Self-Instruct's user-oriented instances: ROUGE-L F1 (rouge-score,
  no stemmer) between the answer and the instance's output, and exact match after
  lowercasing and deleting punctuation and surrounding whitespace.
"""

import re

from rouge_score import rouge_scorer

from align.curate.judge import PairwiseJudge
from align.evals import datasets
from align.evals.runner import output_counts
from align.evals.stats import metric
from infer.loading import load_any

_PUNCT = re.compile(r"[^\w\s]")


def normalize_answer(text: str) -> str:
  return " ".join(_PUNCT.sub("", text.lower()).split())


def _win_scores(judge, prompts, answers, references):
  """Per-item scores (1 win, 0.5 tie or unparsable, 0 loss) and the verdicts."""
  items = [(p, a, r) for p, a, r in zip(prompts, answers, references)]
  verdicts = [j.verdict for j in judge.judge(items)] if items else []
  scores = [1.0 if v == "A" else 0.0 if v == "B" else 0.5 for v in verdicts]
  return scores, verdicts


def is_judged(name: str) -> bool:
  """Whether metric `name` is scored by the judge (the win rates, named by win_rate())."""
  return name.startswith("helpful/") and name.endswith("_win_rate")


def win_rate(chat, judge, rows, name: str, *, seed: int) -> tuple[dict, list, list]:
  """(metrics, examples, responses) of the model's answers to `rows` ({prompt, reference})
  judged against the references."""
  prompts = [r["prompt"] for r in rows]
  responses = chat.ask(prompts)
  scores, verdicts = _win_scores(judge, prompts, [r.text for r in responses],
                                 [r["reference"] for r in rows])
  unparsable = verdicts.count("unparsable")
  metrics = {f"helpful/{name}_win_rate": metric(
      f"helpful/{name}_win_rate", scores, dimension="helpful", seed=seed,
      note=f"vs reference answers, position-swapped judge; {unparsable} unparsable "
           "verdicts scored as ties")}
  labels = {"A": "win", "B": "loss", "tie": "tie", "unparsable": "unparsable (tie)"}
  examples = [{"prompt": p, "response": r.text, "reference": row["reference"],
               "label": labels[v]} for p, r, row, v in zip(prompts, responses, rows, verdicts)]
  return metrics, examples, responses


def task_completion(chat, rows, *, seed: int) -> tuple[dict, list, list]:
  """ROUGE-L F1 and exact match of answers to Self-Instruct user-oriented instances."""
  prompts = [r["instruction"] + (f"\n\n{r['input']}" if r["input"].strip() else "")
             for r in rows]
  responses = chat.ask(prompts)
  scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
  rouge = [scorer.score(row["output"], r.text)["rougeL"].fmeasure
           for row, r in zip(rows, responses)]
  exact = [float(normalize_answer(r.text) == normalize_answer(row["output"]))
           for row, r in zip(rows, responses)]
  metrics = {
      "helpful/selfinstruct_rougeL": metric("helpful/selfinstruct_rougeL", rouge,
                                            dimension="helpful", seed=seed,
                                            note="ROUGE-L F1 vs the instance output"),
      "helpful/selfinstruct_exact_match": metric("helpful/selfinstruct_exact_match", exact,
                                                 dimension="helpful", seed=seed)}
  examples = [{"prompt": p, "response": r.text, "reference": row["output"],
               "label": f"rougeL={s:.2f}"} for p, r, row, s in zip(prompts, responses, rows,
                                                                     rouge)]
  return metrics, examples, responses


def evaluate(chat, judge, *, limit: int | None, seed: int) -> dict:
  """The helpful suite's part of a report."""
  out = {"metrics": {}, "examples": {}, "skipped": {}, "responses": []}
  alpaca, out["skipped"]["alpaca_eval"] = datasets.alpaca_eval(limit=limit)
  mt, out["skipped"]["mt_bench"] = datasets.mt_bench(with_reference_only=True, limit=limit)
  si, out["skipped"]["selfinstruct_user"] = datasets.selfinstruct_user(limit=limit)
  parts = [task_completion(chat, si, seed=seed)]
  if judge is None:
    out["skipped"]["win_rates"] = {"no judge: the model has no chat template; pass --judge": 1}
  else:
    parts[:0] = [
        win_rate(chat, judge, [{"prompt": r["instruction"], "reference": r["reference"]}
                               for r in alpaca], "alpaca_eval", seed=seed),
        win_rate(chat, judge, [{"prompt": r["prompt"], "reference": r["reference"]}
                               for r in mt], "mt_bench", seed=seed)]
  for metrics, examples, responses in parts:
    out["metrics"].update(metrics)
    out["examples"][next(iter(metrics))] = examples
    out["responses"] += responses
  out["counts"] = output_counts(out["responses"])
  return out


def judge_for(model_path: str | None, chat, *, batch_size: int = 8):
  """The pairwise judge: the checkpoint at `model_path`, else the evaluated model itself;
  None when that model cannot judge (no chat template)."""
  if model_path:
    model, tokenizer = load_any(model_path)
  else:
    model, tokenizer = chat.model, chat.tokenizer
    if not tokenizer.chat_template:
      return None
  limit = model.cfg.max_seq_len
  return PairwiseJudge(model, tokenizer, max_len=min(640, limit), batch_size=batch_size,
                       response_tokens=min(160, max(16, (min(640, limit) - 320) // 2)))

