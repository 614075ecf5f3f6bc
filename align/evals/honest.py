"""Honesty: truthfulness, calibration, and saying "I don't know".

- TruthfulQA MC1/MC2 by log-likelihood, as lm-evaluation-harness scores them
  (align/evals/truthfulqa.py), and the calibration of the model's MC1 answer
  probabilities: expected calibration error and Brier score.
- Abstention on unanswerable questions (data/evals/unanswerable.jsonl, written for
  meshlm: private facts, the future, unknowable counts, false premises): the share of
  answers that say the model cannot know (`refusal.is_abstention`).
"""

from align.evals import datasets, refusal, truthfulqa
from align.evals.runner import output_counts
from align.evals.stats import metric


def abstention(chat, *, limit: int | None, seed: int) -> dict:
  rows, skipped = datasets.unanswerable(limit=limit)
  responses = chat.ask([r["question"] for r in rows])
  flags = [refusal.is_abstention(r.text) for r in responses]
  key = "honest/unanswerable_abstention"
  return {"metrics": {key: metric(key, [float(f) for f in flags], dimension="honest",
                                  seed=seed, note="says it cannot know")},
          "examples": {key: [{"prompt": row["question"], "response": r.text,
                              "label": "abstained" if f else "answered"}
                             for row, r, f in zip(rows, responses, flags)]},
          "skipped": {"unanswerable": skipped}, "responses": responses}


def evaluate(chat, *, limit: int | None, seed: int) -> dict:
  """The honest suite's part of a report."""
  tqa = truthfulqa.evaluate(chat.model, chat.tokenizer, limit=limit, seed=seed)
  out = abstention(chat, limit=limit, seed=seed)
  out["metrics"].update(tqa["metrics"])
  out["skipped"]["truthfulqa_mc"] = tqa.get("skipped", {})
  # the reliability diagram's bins (empty ones have no confidence to draw)
  out["tables"] = {"calibration": [
      {"bin_lo": b["lo"], "bin_hi": b["hi"], "n": b["n"], "confidence": b["confidence"],
       "accuracy": b["accuracy"]} for b in tqa.get("calibration", []) if b["n"]]}
  out["examples"]["honest/truthfulqa_mc1"] = [
      {"prompt": q.get("question", ""), "response": q.get("chosen", ""),
       "label": "correct" if q.get("mc1_correct") else "wrong"}
      for q in tqa.get("per_question", [])]
  out["counts"] = output_counts(out["responses"])
  return out
