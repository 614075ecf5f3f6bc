"""The gate and the judge (align/evals/judges.py): reports name their judge by its weights,
and `meshlm gate` compares win rates only when one judge, not the candidate, scored both.

The reports are real: tiny random decoders with SmolLM2's tokenizer and chat template run
the helpful suite through align.evals.suites.evaluate_model, judging each other.
"""

import json
import os
import shutil
import subprocess
import sys
import types

import deps
import pytest
from flax import nnx

from align.evals import gate, judges
from align.evals.helpful import is_judged, judge_for
from align.evals.promote import Promoter
from align.evals.suites import evaluate_model
from models.config import ModelConfig
from models.pretrained import load_pretrained_tokenizer
from models.registry import create_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIN_RATES = ["helpful/alpaca_eval_win_rate", "helpful/mt_bench_win_rate"]
CFG = ModelConfig(vocab_size=49152, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=64, max_seq_len=1024, tie_embeddings=True)


@pytest.fixture(scope="module")
def models():
  tok = load_pretrained_tokenizer(deps.smollm())
  return tok, {name: create_model(CFG, nnx.Rngs(seed)) for seed, name in enumerate("ABJ")}


def judge_of(models, name):
  tok, ms = models
  judge = judge_for(None, types.SimpleNamespace(model=ms[name], tokenizer=tok))
  judge.name = f"tiny-{name}"
  return judge


def evaluate(models, model, judge=None, out=None):
  tok, ms = models
  return evaluate_model(ms[model], tok, "helpful", out and str(out), limit=2, seed=0,
                        judge=judge if judge is None else judge_of(models, judge),
                        model_info={"name": f"tiny-{model}"}, max_new_tokens=4)


@pytest.fixture(scope="module")
def reports(models, tmp_path_factory):
  """{key: (report, path)}: A judged by J (the baseline), B by J, B by A, B by itself, A
  by B."""
  d = tmp_path_factory.mktemp("judged")
  out = {}
  for key, model, judge in (("base", "A", "J"), ("same", "B", "J"), ("other", "B", "A"),
                            ("self", "B", None), ("by_b", "A", "B")):
    out[key] = (evaluate(models, model, judge, d / key), d / key / "report.json")
  return out


def test_a_report_names_its_judge_by_weights(models, reports):
  base, _ = reports["base"]
  own = reports["self"][0]
  _, ms = models
  assert base["judge"] == {"name": "tiny-J", "self": False,
                           "weights_sha256": judges.weights_fingerprint(ms["J"])}
  assert base["model"]["weights_sha256"] == judges.weights_fingerprint(ms["A"])
  assert own["judge"]["self"] is True
  assert own["judge"]["weights_sha256"] == own["model"]["weights_sha256"] \
      == judges.weights_fingerprint(ms["B"])
  assert sorted(n for n in base["metrics"] if is_judged(n)) == WIN_RATES
  # the same weights give the same fingerprint; other weights another one
  assert judges.weights_fingerprint(create_model(CFG, nnx.Rngs(2))) \
      == base["judge"]["weights_sha256"] != own["judge"]["weights_sha256"]


def test_one_judge_compares_every_metric(reports):
  result = gate.compare(reports["base"][0], reports["same"][0], gate.parse_max_drop("all=1"))
  assert result["passed"]
  assert sorted(c["metric"] for c in result["checks"] if c["status"] == "passed") \
      == sorted(reports["base"][0]["metrics"])
  assert "'tiny-J'" in result["judges"]["baseline"] and "'tiny-J'" in result["judges"]["candidate"]


def test_another_judge_is_refused_naming_both(reports):
  base, other = reports["base"][0], reports["other"][0]
  with pytest.raises(gate.JudgeRefused, match="judged by different models") as e:
    gate.compare(base, other)
  for judge in (base["judge"], other["judge"]):
    assert repr(judge["name"]) in str(e.value) and judge["weights_sha256"][:12] in str(e.value)
  for name in WIN_RATES:
    assert name in str(e.value)


def test_a_self_judged_candidate_is_refused(reports):
  base, own = reports["base"][0], reports["self"][0]
  with pytest.raises(gate.JudgeRefused, match="the candidate judged its own answers") as e:
    gate.compare(base, own)
  assert "'tiny-J'" in str(e.value) and "'tiny-B'" in str(e.value)
  assert "the evaluated model itself" in str(e.value)
  # even against a baseline judged by the same weights (the candidate's own)
  with pytest.raises(gate.JudgeRefused, match="its own answers"):
    gate.compare(reports["by_b"][0], own)
  # a baseline that judged itself is allowed: its bias favours the baseline
  assert gate.compare(own, reports["by_b"][0], gate.parse_max_drop("all=1"))["passed"]


def test_skip_judged_compares_the_rest_and_says_why(reports):
  result = gate.compare(reports["base"][0], reports["self"][0], skip_judged=True)
  skipped = {c["metric"]: c["why"] for c in result["checks"] if c["status"] == "skipped"}
  assert sorted(skipped) == WIN_RATES
  assert all("the candidate judged its own answers" in why for why in skipped.values())
  assert {c["metric"] for c in result["checks"] if c["status"] != "skipped"} \
      == set(reports["base"][0]["metrics"]) - set(WIN_RATES)


def test_a_gate_that_skipped_every_metric_gives_no_verdict(reports):
  only_judged = lambda r: dict(r, metrics={n: r["metrics"][n] for n in WIN_RATES})
  base, cand = only_judged(reports["base"][0]), only_judged(reports["self"][0])
  with pytest.raises(gate.NothingCompared, match="no metric was compared") as e:
    gate.compare(base, cand, skip_judged=True)
  assert all(name in str(e.value) for name in WIN_RATES)
  unnamed = dict(base, judge=None)
  assert judges.describe(unnamed).startswith("no judge: the report names none, yet")
  assert judges.describe(dict(unnamed, metrics={})) == \
      "no judge (the report has no judged metrics)"


def test_a_report_without_judge_weights_is_never_compared(reports):
  """Reports made before judges were fingerprinted (schema 1: a phrase in settings.judge)."""
  base = reports["base"][0]
  legacy = {k: v for k, v in base.items() if k != "judge"}
  legacy.update(schema=1, settings=dict(base["settings"], judge="the evaluated model"))
  for b, c in ((legacy, legacy), (legacy, base), (base, legacy)):
    with pytest.raises(gate.JudgeRefused, match="does not say which weights judged it") as e:
      gate.compare(b, c)
    assert "an unknown judge (it says 'the evaluated model')" in str(e.value)
  # the judge-free metrics of a legacy report are still comparable, on request
  assert gate.compare(legacy, base, gate.parse_max_drop("all=1"), skip_judged=True)["passed"]


def test_meshlm_gate_refuses_other_judges_with_exit_status_2(reports, tmp_path):
  run = lambda *a: subprocess.run([sys.executable, "-m", "cli.main", "gate", *map(str, a)],
                                  cwd=REPO, capture_output=True, text=True, timeout=120,
                                  check=False)
  base = reports["base"][1]
  ok = run("--baseline", base, "--candidate", reports["same"][1], "--max_drop", "all=1")
  assert ok.returncode == 0 and "PASSED" in ok.stdout, ok.stderr
  for key, why, judge in (("self", "the candidate judged its own answers", "tiny-B"),
                          ("other", "judged by different models", "tiny-A")):
    refused = run("--baseline", base, "--candidate", reports[key][1])
    assert refused.returncode == 2 and why in refused.stderr, refused.stderr
    assert "'tiny-J'" in refused.stderr and f"'{judge}'" in refused.stderr
    assert "PASSED" not in refused.stdout
  skipped = run("--baseline", base, "--candidate", reports["self"][1], "--skip_judged",
                "--max_drop", "all=1", "--json", tmp_path / "verdict.json")
  assert skipped.returncode == 0, skipped.stderr
  for name in WIN_RATES:
    assert f"SKIPPED {name}: scored by a judge" in skipped.stdout
  assert "2 skipped" in skipped.stdout
  assert json.loads((tmp_path / "verdict.json").read_text())["passed"] is True


def test_the_training_gate_refuses_a_baseline_of_another_judge(models, reports, tmp_path):
  """Its default judge is the starting model; a baseline judged by another is refused
  before training, and one judged by the starting model is accepted."""
  tok, ms = models
  cfg = types.SimpleNamespace(suite="helpful", judge="", baseline=str(reports["base"][1]),
                              max_drop="", limit=2, seed=0, max_new_tokens=4)
  plan = types.SimpleNamespace(tokenizer=tok, model_cfg=CFG)
  with pytest.raises(ValueError, match="judged by different models") as e:
    Promoter(cfg, str(tmp_path / "run"), plan, ms["B"], 0)
  assert "'tiny-J'" in str(e.value) and "eval_gate.judge" in str(e.value)
  cfg.baseline = str(reports["self"][1])  # B judged by B
  promoter = Promoter(cfg, str(tmp_path / "run"), plan, ms["B"], 0)
  result = promoter.check(1, ms["A"])
  assert {c["metric"] for c in result["checks"] if c["status"] != "skipped"} >= set(WIN_RATES)
  step = json.loads((tmp_path / "run" / "evals" / "step_1" / "report.json").read_text())
  assert step["judge"]["weights_sha256"] == judges.weights_fingerprint(ms["B"])
  assert step["judge"]["self"] is False


def test_a_resumed_training_gate_keeps_the_starting_judge(models, tmp_path):
  """The default judge is the model the run started from, kept in WORKDIR/evals/judge: a
  resumed run (whose own starting model is the restored one) judges with it, so its steps
  compare with step 0; a run without the kept judge is refused before training, naming it."""
  tok, ms = models
  cfg = types.SimpleNamespace(suite="helpful", judge="", baseline="", max_drop="", limit=2,
                              seed=0, max_new_tokens=4)
  plan = types.SimpleNamespace(tokenizer=tok, model_cfg=CFG)
  run = tmp_path / "run"
  Promoter(cfg, str(run), plan, ms["A"], 0)  # fresh: evaluates step 0, judged by A itself
  step_0 = json.loads((run / "evals" / "step_0" / "report.json").read_text())
  assert step_0["judge"]["weights_sha256"] == judges.weights_fingerprint(ms["A"])
  resumed = Promoter(cfg, str(run), plan, ms["B"], 5)  # restored at step 5: the model is B
  kept = nnx.merge(resumed.judge.graphdef, resumed.judge.state)
  assert judges.weights_fingerprint(kept) == judges.weights_fingerprint(ms["A"])
  result = resumed.check(6, ms["B"])
  assert {c["metric"] for c in result["checks"] if c["status"] != "skipped"} >= set(WIN_RATES)
  shutil.rmtree(run / "evals" / "judge")
  with pytest.raises(ValueError, match="judged by different models") as e:
    Promoter(cfg, str(run), plan, ms["B"], 5)
  assert "eval_gate.judge" in str(e.value)
