"""The regression gate (align/evals/gate.py): tolerances, confidence intervals, broken
evaluations, bad input, and `meshlm gate`'s exit status."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from align.evals import gate
from align.evals.stats import bootstrap_ci, calibration, metric

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report(**metrics):
  return {"schema": 1, "suite": "hhh", "metrics": metrics}


def rate(name, ones, n=200, dimension="harmless", higher=True):
  return metric(name, [1.0] * ones + [0.0] * (n - ones), dimension=dimension,
                higher_is_better=higher)


def test_bootstrap_ci_is_seeded_and_covers_the_mean():
  x = np.r_[np.ones(30), np.zeros(70)]
  a, b = bootstrap_ci(x, seed=3, name="m"), bootstrap_ci(x, seed=3, name="m")
  assert a == b
  assert a != bootstrap_ci(x, seed=4, name="m")
  lo, hi = a
  assert lo < 0.3 < hi
  # the normal-approximation half-width is 1.96 * sqrt(.3 * .7 / 100) = 0.0898
  assert abs((hi - lo) / 2 - 0.0898) < 0.015
  assert all(math.isnan(v) for v in bootstrap_ci([], name="empty"))


def test_calibration_ece_and_brier_by_hand():
  ece, brier = calibration([0.9, 0.9, 0.2, 0.2], [1, 0, 0, 0])
  # bucket 0.9: accuracy 0.5 vs confidence 0.9 (weight 1/2); bucket 0.2: 0 vs 0.2 (1/2)
  assert ece == pytest.approx(0.5 * 0.4 + 0.5 * 0.2)
  assert brier == pytest.approx((0.01 + 0.81 + 0.04 + 0.04) / 4)


def test_identical_reports_pass_and_a_real_drop_fails():
  base = report(**{"harmless/advbench_refusal": rate("harmless/advbench_refusal", 150)})
  assert gate.compare(base, base)["passed"]
  worse = report(**{"harmless/advbench_refusal": rate("harmless/advbench_refusal", 60)})
  result = gate.compare(base, worse)
  assert not result["passed"]
  (failure,) = result["failures"]
  assert failure["metric"] == "harmless/advbench_refusal" and "dropped by 0.45" in failure["why"]
  # the same candidate passes under a tolerance that covers the drop
  assert gate.compare(base, worse, gate.parse_max_drop("harmless=0.5"))["passed"]
  assert gate.compare(base, worse, gate.parse_max_drop("harmless/advbench_refusal=0.5"))["passed"]


def test_a_drop_inside_the_confidence_interval_passes():
  base = report(**{"helpful/win": rate("helpful/win", 10, n=20, dimension="helpful")})
  cand = report(**{"helpful/win": rate("helpful/win", 8, n=20, dimension="helpful")})
  result = gate.compare(base, cand)
  assert result["passed"]
  assert "within the candidate's CI" in result["checks"][0]["why"]


def test_lower_is_better_metrics_regress_upwards():
  name = "harmless/xstest_safe_false_refusal"
  base = report(**{name: rate(name, 10, higher=False)})
  assert not gate.compare(base, report(**{name: rate(name, 80, higher=False)}))["passed"]
  assert gate.compare(base, report(**{name: rate(name, 2, higher=False)}))["passed"]


def test_broken_evaluations_fail():
  m = rate("honest/x", 100, dimension="honest")
  base = report(**{"honest/x": m})
  missing = gate.compare(base, report())
  assert not missing["passed"] and "missing" in missing["failures"][0]["why"]
  nan = dict(m, value=float("nan"))
  assert not gate.compare(base, report(**{"honest/x": nan}))["passed"]
  smaller = rate("honest/x", 50, n=100, dimension="honest")
  result = gate.compare(base, report(**{"honest/x": smaller}))
  assert not result["passed"] and "not comparable" in result["failures"][0]["why"]


def test_reports_made_differently_are_not_compared():
  m = rate("honest/x", 100, dimension="honest")
  base = dict(report(**{"honest/x": m}), seed=0,
              settings={"max_new_tokens": 64, "decoding": "greedy"})
  for change in ({"seed": 1}, {"settings": {"max_new_tokens": 128, "decoding": "greedy"}},
                 {"settings": {"max_new_tokens": 64, "decoding": "sampled"}}):
    with pytest.raises(ValueError, match="not comparable"):
      gate.compare(base, dict(base, **change))
  assert gate.compare(base, dict(base))["passed"]
  # the judge matters only to judged metrics (tests/test_eval_judges.py), not to this one
  assert gate.compare(dict(base, judge=None), dict(base, judge={"name": "j"}))["passed"]


def test_bad_tolerances_and_reports_are_refused(tmp_path):
  for bad in ("helpful", "helpful=-1", "helpful=x", "=0.1"):
    with pytest.raises(ValueError, match="--max_drop"):
      gate.parse_max_drop(bad)
  base = report(**{"helpful/win": rate("helpful/win", 10, dimension="helpful")})
  with pytest.raises(ValueError, match="neither a dimension"):
    gate.compare(base, base, {"helpfull": 0.1})
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    gate.load_report(str(tmp_path / "bad.json"))
  (tmp_path / "nometrics.json").write_text("{}")
  with pytest.raises(ValueError, match="no 'metrics'"):
    gate.load_report(str(tmp_path / "nometrics.json"))
  with pytest.raises(ValueError, match="does not exist"):
    gate.load_report(str(tmp_path / "absent.json"))


def test_meshlm_gate_exit_status(tmp_path):
  name = "harmless/advbench_refusal"
  paths = {}
  for key, ones in (("base", 150), ("same", 150), ("worse", 40)):
    paths[key] = tmp_path / f"{key}.json"
    paths[key].write_text(json.dumps(report(**{name: rate(name, ones)})))
  run = lambda *a: subprocess.run([sys.executable, "-m", "cli.main", "gate", *a], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
  ok = run("--baseline", str(paths["base"]), "--candidate", str(paths["same"]))
  assert ok.returncode == 0 and "PASSED" in ok.stdout
  bad = run("--baseline", str(paths["base"]), "--candidate", str(paths["worse"]),
            "--json", str(tmp_path / "verdict.json"))
  assert bad.returncode == 1
  assert f"REGRESSED {name}" in bad.stdout and "FAILED" in bad.stdout
  assert json.loads((tmp_path / "verdict.json").read_text())["passed"] is False
  unusable = run("--baseline", str(tmp_path / "absent.json"), "--candidate", str(paths["same"]))
  assert unusable.returncode == 2 and "does not exist" in unusable.stderr
