"""Harmlessness: refusing what should be refused, and not refusing what shouldn't.

- Refusal rate on harmful prompts: AdvBench behaviours, XSTest's 200 unsafe (contrast)
  prompts and JailbreakBench's 100 behaviours (higher is better).
- False-refusal rate on XSTest's 250 safe prompts (lower is better): XSTest counts full
  and partial refusals.

Each rate is reported twice: by the standard refusal-substring match (GCG/AdvBench test
prefixes; the number papers quote) and by the learned classifier (MiniLM embeddings + a
logistic head, align/evals/refusal.py), whose agreement with the string match on this
run's answers is reported too. An empty answer counts as a refusal (nothing was provided).
"""

import numpy as np

from align.evals import datasets, refusal
from align.evals.runner import output_counts
from align.evals.stats import metric

SETS = (  # (metric stem, loader, loader kwargs, higher_is_better)
    ("advbench_refusal", datasets.advbench, {}, True),
    ("xstest_unsafe_refusal", datasets.xstest, {"label": "unsafe"}, True),
    ("jbb_refusal", datasets.jbb_behaviors, {}, True),
    ("xstest_safe_false_refusal", datasets.xstest, {"label": "safe"}, False),
)


def classifiers(learned=None):
  """(name, texts -> refusal flags) pairs: the string match, and the learned classifier."""
  learned = learned if learned is not None else refusal.train_default()
  return [("string", lambda texts: [refusal.string_refusal(t) for t in texts]),
          ("learned", lambda texts: [bool(x) for x in learned.predict(texts)])]


def evaluate(chat, *, limit: int | None, seed: int, learned=None) -> dict:
  """The harmless suite's part of a report."""
  out = {"metrics": {}, "examples": {}, "skipped": {}, "responses": [], "tables": {}}
  judges = classifiers(learned)
  agree_rows = []
  for stem, loader, kwargs, higher in SETS:
    rows, skipped = loader(limit=limit, **kwargs)
    out["skipped"][f"{stem}"] = skipped
    responses = chat.ask([r["prompt"] for r in rows])
    failed = sum(r.finish_reason == "error" for r in responses)
    if failed:
      skipped = out["skipped"][stem] = dict(skipped, generation_error=failed)
    kept = [(row, r) for row, r in zip(rows, responses) if r.finish_reason != "error"]
    prompts = [row["prompt"] for row, _ in kept]
    texts = [r.text for _, r in kept]
    flags = {name: fn(texts) for name, fn in judges}
    for name, flag in flags.items():
      key = f"harmless/{stem}" + ("" if name == "string" else "_learned")
      out["metrics"][key] = metric(key, [float(f) for f in flag], dimension="harmless",
                                   higher_is_better=higher, seed=seed,
                                   note=f"{name} refusal classifier")
    agree = [float(a == b) for a, b in zip(flags["string"], flags["learned"])]
    agree_rows.append({"set": stem, "n": len(agree),
                       "agreement": float(np.mean(agree)) if agree else float("nan")})
    out["examples"][f"harmless/{stem}"] = [
        {"prompt": p, "response": t, "label": ("refusal" if s else "compliance") +
         ("" if s == l else " (learned: " + ("refusal" if l else "compliance") + ")")}
        for p, t, s, l in zip(prompts, texts, flags["string"], flags["learned"])]
    out["responses"] += responses
  out["tables"]["refusal_classifier_agreement"] = agree_rows
  out["counts"] = output_counts(out["responses"])
  return out
