"""Who judged a report, and when two reports' judged metrics may be compared.

The helpfulness win rates (align/evals/helpful.py) are scored by a judge model, so they
measure the judge as much as the model, and a model that judges its own answers can grade
itself up. A report therefore names its judge by a fingerprint of the judge's weights,

    report["judge"] = {"name": ..., "weights_sha256": ..., "self": bool}

(None when nothing was judged), and the evaluated model by the same fingerprint
(report["model"]["weights_sha256"]); "self" is true when the two are equal.

The gate's rule (refusal()): judged metrics are compared only when both reports name a
judge by its weights, the weights are the same, and the candidate did not judge itself. A
baseline that judged itself is allowed: the judge's bias then favours the baseline, so the
gate errs towards failing the candidate (the in-training gate's default judge is the
starting model, which is also its baseline). Reports made before judges were fingerprinted
(schema 1) have an unknown judge, and their judged metrics are never compared.
"""

import hashlib

import jax
import numpy as np
from flax import nnx

from align.evals.helpful import is_judged


def weights_fingerprint(model) -> str:
  """sha256 over the model's parameter arrays: each one's path, dtype, shape and bytes, in
  path order. The same weights give the same fingerprint however they were loaded."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  for path, leaf in leaves[0]:
    arr = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()


def judge_record(judge, name: str, model_weights: str | None) -> dict:
  """report["judge"] for a align.curate.judge.PairwiseJudge named `name`."""
  weights = weights_fingerprint(nnx.merge(judge.graphdef, judge.state))
  return {"name": name, "weights_sha256": weights, "self": weights == model_weights}


def self_record(name: str, model_weights: str) -> dict:
  """report["judge"] when the evaluated model judged its own answers."""
  return {"name": name, "weights_sha256": model_weights, "self": True}


def _weights(report: dict) -> str | None:
  j = report.get("judge")
  w = j.get("weights_sha256") if isinstance(j, dict) else None
  return w if isinstance(w, str) and w else None


def judged_itself(report: dict) -> bool:
  j, model = report.get("judge"), report.get("model")
  own = model.get("weights_sha256") if isinstance(model, dict) else None
  return isinstance(j, dict) and (j.get("self") is True or (own is not None
                                                             and _weights(report) == own))


def describe(report: dict) -> str:
  """The report's judge in words, for messages: its name and weights, or why it is unknown."""
  w = _weights(report)
  if w is None and "judge" in report and report["judge"] is None:
    if any(is_judged(n) for n in report.get("metrics", {})):
      return "no judge: the report names none, yet it has judged metrics (win rates)"
    return "no judge (the report has no judged metrics)"
  if w is None:
    # a schema-1 report's settings.judge is a name or "the evaluated model", not an identity
    legacy = (report.get("settings") or {}).get("judge")
    said = f" (it says {legacy!r})" if legacy else ""
    return (f"an unknown judge{said}: the report names no judge weights (made before "
            "meshlm fingerprinted judges)")
  mine = ", the evaluated model itself" if judged_itself(report) else ""
  return f"{report['judge'].get('name')!r} (weights sha256 {w[:12]}{mine})"


def shared_judged(baseline: dict, candidate: dict) -> list[str]:
  return sorted(n for n in baseline.get("metrics", {}) if is_judged(n)
                and n in candidate.get("metrics", {}))


def reason(baseline: dict, candidate: dict) -> str | None:
  """Why the judged metrics the two reports share must not be compared, in a few words;
  None when they may be, or when they share none."""
  if not shared_judged(baseline, candidate):
    return None
  if _weights(baseline) is None or _weights(candidate) is None:
    return "a report does not say which weights judged it"
  if judged_itself(candidate):
    return "the candidate judged its own answers"
  if _weights(baseline) != _weights(candidate):
    return "the reports were judged by different models"
  return None


def refusal(baseline: dict, candidate: dict) -> str | None:
  """reason() in full, naming both judges and what to do; None when there is none."""
  why = reason(baseline, candidate)
  if why is None:
    return None
  return (f"{why}, so the judged metrics {shared_judged(baseline, candidate)} are not "
          f"comparable: the baseline was judged by {describe(baseline)}, the candidate by "
          f"{describe(candidate)}. Evaluate both with the same --judge (for the candidate, "
          "one that is not the candidate), or pass --skip_judged to compare only the "
          "metrics no judge scored")
