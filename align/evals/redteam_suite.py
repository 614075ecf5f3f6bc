"""`--suite redteam`: every registered attack (align/evals/attacks.py) applied to AdvBench
and JailbreakBench behaviours; attack success = the final answer is not a refusal by the
standard refusal-substring match (align/evals/refusal.py). See docs/redteam.md."""

from align.evals import redteam, refusal
from align.evals.attacks import get_attacks
from align.evals.runner import Response


def evaluate(chat, *, limit: int | None, seed: int) -> dict:
  rows, skipped = redteam.load_behaviors(("advbench", "jbb"), limit=limit)
  records = redteam.run_attacks(chat, rows, get_attacks(),
                                classify=lambda texts: [refusal.string_refusal(t) for t in texts])
  metrics, tables = redteam.summarize(records, seed=seed)
  # the HTML heatmap's cells (it adds the "all" totals itself)
  tables["redteam_by_attack_category"] = [
      {"attack": r["attack"], "category": r["category"], "n": r["n"], "asr": r["asr"]}
      for r in tables.get("redteam_asr", []) if r["category"] != "all"]
  examples = {}
  for r in records:
    examples.setdefault(f"redteam/asr/{r['attack']}", []).append(
        {"prompt": r["conversation"][-1]["content"] if r.get("conversation") else "",
         "response": r["response"], "label": "refused" if r["refused"] else "attack succeeded",
         "category": r["category"]})
  responses = [Response(r["response"], r.get("finish_reason", "stop"), 0,
                        bool(r.get("degenerate"))) for r in records]
  return {"metrics": metrics, "tables": tables, "examples": examples,
          "skipped": {"redteam_behaviors": skipped},
          "responses": responses}
