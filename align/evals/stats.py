"""Metrics with sample sizes and seeded bootstrap confidence intervals.

Every number a report holds is a `metric(...)` dict: value, n, a 95% percentile-bootstrap
interval (B resamples drawn from a generator seeded by the report's seed and the metric's
name, so the same inputs give the same interval), the dimension it belongs to and which
way is better. `higher_is_better=False` marks rates where less is better (false refusals,
attack success, calibration error).
"""

import hashlib
from typing import Callable, Sequence

import numpy as np

DIMENSIONS = ("helpful", "harmless", "honest", "redteam")
RESAMPLES = 1000


def _rng(seed: int, name: str) -> np.random.Generator:
  digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
  return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def bootstrap_ci(values: Sequence, stat: Callable = np.mean, *, seed: int = 0, name: str = "",
                 resamples: int = RESAMPLES, alpha: float = 0.05) -> tuple[float, float]:
  """Percentile bootstrap interval of `stat` over rows of `values` (a 1-D array, or a 2-D
  array whose rows are resampled together, for statistics of several columns)."""
  x = np.asarray(values, np.float64)
  n = len(x)
  if n == 0:
    return (float("nan"), float("nan"))
  idx = _rng(seed, name).integers(0, n, size=(resamples, n))
  stats = np.array([stat(x[i]) for i in idx], np.float64)
  lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
  return (float(lo), float(hi))


def metric(name: str, values: Sequence, *, dimension: str, higher_is_better: bool = True,
           stat: Callable = np.mean, seed: int = 0, note: str = "") -> dict:
  """A report metric: `stat` of `values` (per-example scores), n, and its bootstrap CI."""
  if dimension not in DIMENSIONS:
    raise ValueError(f"metric {name!r}: dimension {dimension!r} is not one of {DIMENSIONS}")
  x = np.asarray(values, np.float64)
  value = float(stat(x)) if len(x) else float("nan")
  lo, hi = bootstrap_ci(x, stat, seed=seed, name=name)
  out = {"value": value, "n": int(len(x)), "ci": [lo, hi], "dimension": dimension,
         "higher_is_better": bool(higher_is_better)}
  if note:
    out["note"] = note
  return out


def oriented(m: dict, key: str = "value") -> float:
  """The metric (or a CI end) turned so that higher is better."""
  v = m[key] if key == "value" else m["ci"][0 if key == "lo" else 1]
  return v if m["higher_is_better"] else 1.0 - v


def calibration(prob_N: Sequence[float], correct_N: Sequence[bool], buckets: int = 10
                ) -> tuple[float, float]:
  """(expected calibration error, Brier score) of confidences `prob_N` in answers that were
  `correct_N`: ECE over equal-width confidence buckets, Brier = mean (p - correct)^2."""
  p = np.asarray(prob_N, np.float64)
  y = np.asarray(correct_N, np.float64)
  if len(p) == 0:
    return float("nan"), float("nan")
  edges = np.linspace(0.0, 1.0, buckets + 1)
  idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, buckets - 1)
  ece = sum(abs(y[idx == k].mean() - p[idx == k].mean()) * (idx == k).mean()
            for k in range(buckets) if (idx == k).any())
  return float(ece), float(np.mean((p - y) ** 2))
