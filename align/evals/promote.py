"""Evaluation inside training: every N steps, evaluate the current model, gate it against a
baseline report, and promote the checkpoint only if it passes.

Config (experiments/defaults.py, `eval_gate`):
  every      evaluate at every N-th step (and the last); 0: off
  suite      an `meshlm eval` suite (hhh, helpful, harmless, honest, redteam)
  limit      rows per dataset (small: this runs inside training)
  baseline   a report.json; empty: the starting model's own report (WORKDIR/evals/step_0),
             so a run may never promote a checkpoint that is worse than where it started
  max_drop   the gate's tolerances, "helpful=0.02,..." (align/evals/gate.py)
  judge      the helpfulness judge checkpoint; empty: the model being trained

Each evaluation writes WORKDIR/evals/step_N/{report.json,report.html,responses.jsonl,
gate.json}. WORKDIR/promoted.json names the newest step that passed; a failing step never
replaces it, and the loop says why. Promotion is advice to whoever deploys: the checkpoint
itself is kept either way (training continues; a later step may pass again).
"""

import json
import os

from align.evals import cli, gate


def check_protected(suite: str, decontam_cfg=None) -> None:
  """Evaluation first: the sets `suite` reads must be registered as protected and selected
  by the run's decontamination check, so its training data cannot contain them."""
  from align import decontam
  registered = {e["name"] for e in decontam.load_registry()}
  missing = [s for s in cli.suite_sets(suite) if s not in registered]
  if missing:
    raise ValueError(f"eval_gate.suite={suite!r} reads {missing}, which are not registered in "
                     f"{decontam.REGISTRY}: register them so training data is checked")
  selected = (decontam_cfg or {}).get("eval_sets", "default")
  names = selected if isinstance(selected, (list, tuple)) else str(selected).split(",")
  names = [n.strip() for n in names if n.strip()]
  unguarded = [s for s in cli.suite_sets(suite) if "default" not in names and s not in names]
  if unguarded:
    raise ValueError(f"data.decontam.eval_sets={selected!r} leaves {unguarded} unchecked, "
                     f"but eval_gate.suite={suite!r} evaluates on them")


def validate(cfg, process_count: int, decontam_cfg=None) -> None:
  """Refuses an eval_gate config that cannot run, before the workdir is written."""
  if not cfg or not cfg.get("every"):
    return
  if cfg.every < 0:
    raise ValueError(f"eval_gate.every={cfg.every} must be >= 0 (0: off)")
  if cfg.suite not in cli.SUITES:
    raise ValueError(f"eval_gate.suite={cfg.suite!r} must be one of {sorted(cli.SUITES)}")
  if cfg.limit is not None and cfg.limit < 1:
    raise ValueError(f"eval_gate.limit={cfg.limit} must be >= 1")
  if cfg.baseline and not os.path.exists(cfg.baseline):
    raise ValueError(f"eval_gate.baseline={cfg.baseline} does not exist")
  gate.parse_max_drop(cfg.max_drop)
  check_protected(cfg.suite, decontam_cfg)
  if process_count > 1:
    raise ValueError("eval_gate runs in single-process runs only (its generation is local)")


class Promoter:
  """The loop's evaluation gate (see the module docstring)."""

  def __init__(self, cfg, workdir: str, tokenizer):
    self.cfg, self.workdir, self.tokenizer = cfg, workdir, tokenizer
    self.root = os.path.join(workdir, "evals")
    self.judge = None
    if cfg.judge:
      from align.evals.helpful import judge_for
      self.judge = judge_for(cfg.judge, None)

  def due(self, step: int, last: int) -> bool:
    return bool(self.cfg.every) and (step % self.cfg.every == 0 or step == last)

  def _evaluate(self, model, step: int) -> tuple[dict, str]:
    out = os.path.join(self.root, f"step_{step}")
    report = cli.evaluate_model(model, self.tokenizer, self.cfg.suite, out,
                                limit=self.cfg.limit, seed=self.cfg.seed, judge=self.judge,
                                model_info={"workdir": self.workdir, "step": step},
                                max_new_tokens=self.cfg.max_new_tokens)
    return report, os.path.join(out, "report.json")

  def baseline_path(self, model_at_start=None) -> str:
    """The baseline report: the configured one, or the starting model's (evaluated once)."""
    if self.cfg.baseline:
      return self.cfg.baseline
    path = os.path.join(self.root, "step_0", "report.json")
    if not os.path.exists(path):
      if model_at_start is None:
        raise ValueError("eval_gate has no baseline: set eval_gate.baseline, or start the run "
                         "from step 0 so the starting model is evaluated")
      self._evaluate(model_at_start, 0)
    return path

  def check(self, step: int, model) -> dict:
    """Evaluates `model` (the step's params), gates it, promotes it if it passed."""
    baseline = gate.load_report(self.baseline_path())
    report, path = self._evaluate(model, step)
    result = gate.compare(baseline, report, gate.parse_max_drop(self.cfg.max_drop))
    result.update(step=step, report=path, baseline=self.baseline_path())
    with open(os.path.join(os.path.dirname(path), "gate.json"), "w") as f:
      json.dump(result, f, indent=1)
    if result["passed"]:
      promoted = os.path.join(self.workdir, "promoted.json")
      tmp = promoted + ".tmp"
      with open(tmp, "w") as f:
        json.dump({"step": step, "report": path, "baseline": result["baseline"]}, f, indent=1)
      os.replace(tmp, promoted)
      print(f"meshlm: step {step} passed the evaluation gate; promoted", flush=True)
    else:
      why = "; ".join(f"{c['metric']}: {c['why']}" for c in result["failures"])
      print(f"meshlm: step {step} NOT promoted: failed the evaluation gate ({why})", flush=True)
    return result
