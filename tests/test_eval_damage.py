"""The gate catches a deliberately damaged checkpoint, end to end through the CLI.

A small model (SmolLM2's tokenizer, 3M parameters) is taught by `meshlm sft` to refuse the
red-team prompts of hh-rlhf harmless-base, then damaged by SFT on refusal-free completions
of the same kind of prompts (hh-rlhf's rejected, more harmful replies). The damaged run
gates itself (eval_gate) and is refused promotion; `meshlm gate` fails the damaged
checkpoint and passes the original against itself (its self-judged win rates skipped); and
two evaluations of one model give byte-identical reports.
"""

import json
import os
import subprocess
import sys

import pytest

import deps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
deps.smollm()  # its tokenizer; experiments/gate_damage.py finds it on its own


def run(*args, check=True):
  p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                     timeout=900, env=dict(os.environ, PYTHONPATH=REPO))
  if check and p.returncode != 0:
    raise AssertionError(f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
  return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  d = tmp_path_factory.mktemp("damage")
  for kind in ("refuse", "comply"):
    out = run("-m", "align.evals.damage", "--kind", kind, "--out", str(d / f"{kind}.jsonl"),
              "--limit", "400")
    assert json.loads(out.stdout)["rows"] > 100
  run("-m", "cli.main", "sft", "--config", "experiments/gate_damage.py:tiny_refuse",
      "--workdir", str(d / "refuse"), f"--config.data.path={d / 'refuse.jsonl'}")
  # the starting (refusing) model judges helpfulness at every gated step
  damaged = run("-m", "cli.main", "sft", "--config", "experiments/gate_damage.py:tiny_comply",
                "--workdir", str(d / "comply"), f"--config.data.path={d / 'comply.jsonl'}",
                f"--config.init_from={d / 'refuse'}", f"--config.eval_gate.judge={d / 'refuse'}")
  return d, damaged


GOLDEN = os.path.join(REPO, "tests", "golden", "eval_tiny_refuse_hhh.json")


def evaluate(model, judge, out):
  """What the damaged run's eval_gate runs (experiments/gate_damage.py), from the CLI."""
  return run("-m", "cli.main", "eval", "--model", str(model), "--judge", str(judge), "--suite",
             "hhh", "--limit", "16", "--max_new_tokens", "16", "--out", str(out))


def gate(baseline, candidate, *extra):
  return run("-m", "cli.main", "gate", "--baseline", str(baseline), "--candidate",
             str(candidate), *extra, check=False)


def test_the_damaged_run_is_not_promoted(runs):
  d, damaged = runs
  assert "NOT promoted: failed the evaluation gate" in damaged.stdout
  assert not os.path.exists(d / "comply" / "promoted.json")
  verdict = json.loads((d / "comply" / "evals" / "step_40" / "gate.json").read_text())
  assert not verdict["passed"]
  failed = {f["metric"] for f in verdict["failures"]}
  assert {"harmless/advbench_refusal", "harmless/jbb_refusal"} <= failed, failed
  start = json.loads((d / "comply" / "evals" / "step_0" / "report.json").read_text())
  assert start["metrics"]["harmless/advbench_refusal"]["value"] >= 0.8  # it learned to refuse


def test_gate_fails_the_damaged_checkpoint_and_passes_the_original(runs):
  """The original, evaluated again from its workdir by `meshlm eval`, passes against the
  baseline the run made of it; the damaged checkpoint fails against that evaluation."""
  d, _ = runs
  evaluate(d / "refuse", d / "refuse", d / "eval_refuse")
  damaged = d / "comply" / "evals" / "step_40" / "report.json"
  failed = gate(d / "eval_refuse" / "report.json", damaged)
  assert failed.returncode == 1, failed.stdout + failed.stderr
  assert "REGRESSED harmless/advbench_refusal" in failed.stdout
  # the original judged its own answers there, so its win rates are not compared
  step_0 = d / "comply" / "evals" / "step_0" / "report.json"
  refused = gate(step_0, d / "eval_refuse" / "report.json")
  assert refused.returncode == 2 and "the candidate judged its own answers" in refused.stderr
  passed = gate(step_0, d / "eval_refuse" / "report.json", "--skip_judged")
  assert passed.returncode == 0, passed.stdout + passed.stderr
  assert "SKIPPED helpful/alpaca_eval_win_rate: scored by a judge" in passed.stdout
  for name in ("report.json", "report.html", "responses.jsonl"):
    assert (d / "eval_refuse" / name).stat().st_size > 0
  assert not [p for p in os.listdir(d / "eval_refuse") if ".tmp" in p]


def test_evaluation_matches_the_committed_baseline(runs):
  """CI's gate: the tiny model's hhh report against one committed from an earlier run, so a
  change that silently breaks an evaluation (a metric gone, NaN, resized or collapsed)
  fails the build."""
  d, _ = runs
  if not (d / "eval_refuse" / "report.json").exists():
    evaluate(d / "refuse", d / "refuse", d / "eval_refuse")
  # the golden report predates judge fingerprints: its win rates are never compared
  result = gate(GOLDEN, d / "eval_refuse" / "report.json", "--skip_judged")
  assert result.returncode == 0, result.stdout + result.stderr
  assert "SKIPPED helpful/mt_bench_win_rate: scored by a judge" in result.stdout
  golden = json.loads(open(GOLDEN).read())
  assert {m["dimension"] for m in golden["metrics"].values()} == {"helpful", "harmless",
                                                                  "honest"}


def test_the_same_model_and_seed_give_identical_reports(runs):
  """The starting model evaluated inside training (eval_gate, step 0) and by `meshlm eval`
  from its workdir: every score, table, count and example is identical."""
  d, _ = runs
  if not (d / "eval_refuse" / "report.json").exists():
    evaluate(d / "refuse", d / "refuse", d / "eval_refuse")
  a = json.loads((d / "eval_refuse" / "report.json").read_text())
  b = json.loads((d / "comply" / "evals" / "step_0" / "report.json").read_text())
  for key in ("metrics", "dimensions", "tables", "counts", "skipped", "examples", "seed",
              "limit", "suite", "settings", "judge"):
    # compared as JSON text: a NaN (a metric without examples) never equals itself
    assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
