"""Evaluation inside training: every N steps, evaluate the current model, gate it against a
baseline report, and promote it only if it passes.

Config (train/defaults.py, `eval_gate`):
  every      evaluate at every N-th step (and the last); 0: off
  suite      an `meshlm eval` suite (hhh, helpful, harmless, honest, redteam)
  limit      rows per dataset (small: this runs inside training)
  baseline   a report.json made the same way (seed, answer length, and for the win rates
             the same judge weights); empty: the starting model's own report
             (WORKDIR/evals/step_0), so a run never promotes a model worse than where it
             started. A baseline judged by another judge is refused before training.
  max_drop   the gate's tolerances, "helpful=0.02,..." (align/evals/gate.py)
  judge      the helpfulness judge checkpoint; empty: a frozen copy of the model as the run
             started, saved to WORKDIR/evals/judge/ so a resumed run keeps the same judge
             (one judge for every step, never the model judging itself)

make_gate(config) builds the loop's hook (train/gate.py) from the config, None when
eval_gate.every is 0; the caller passes it to train(gate=...).

Each evaluation writes WORKDIR/evals/step_N/{report.json,report.html,responses.jsonl,
gate.json}. A step that passes is exported to WORKDIR/promoted/ (a plain loadable workdir,
so checkpoint rotation never deletes it: `meshlm generate|eval --model WORKDIR/promoted`)
and named in WORKDIR/promoted.json; a failing step is never promoted, and the loop prints
why. Training continues either way: a later step may pass again.
"""

import os
import shutil

import jax
import jax.numpy as jnp
from flax import nnx

from align.evals import gate, judges, suites
from align.evals.helpful import judge_for
from train import decontam
from train.gate import gate_configured
from train.report_paths import portable_path
from train.workdir import is_workdir, save_model

GENERATING_ARCHS = ("decoder", "prefix_lm")
JUDGE_DIR = "judge"  # WORKDIR/evals/judge: the default judge, kept for resumes


def check_protected(suite: str, decontam_cfg=None) -> None:
  """Evaluation first: the sets `suite` reads must be registered as protected and selected
  by the run's decontamination check, so its training data cannot contain them."""
  registered = {e["name"] for e in decontam.load_registry()}
  missing = [s for s in suites.suite_sets(suite) if s not in registered]
  if missing:
    raise ValueError(f"eval_gate.suite={suite!r} reads {missing}, which are not registered in "
                     f"{decontam.REGISTRY}: register them so training data is checked")
  selected = (decontam_cfg or {}).get("eval_sets", "default")
  names = selected if isinstance(selected, (list, tuple)) else str(selected).split(",")
  names = [n.strip() for n in names if n.strip()]
  unguarded = [s for s in suites.suite_sets(suite) if "default" not in names and s not in names]
  if unguarded:
    raise ValueError(f"data.decontam.eval_sets={selected!r} leaves {unguarded} unchecked, "
                     f"but eval_gate.suite={suite!r} evaluates on them")


def validate(cfg, process_count: int, decontam_cfg=None, *, task_name: str = "lm",
             arch: str = "decoder") -> None:
  """Refuses an eval_gate config that cannot run, before the workdir is written."""
  if not cfg or not cfg.get("every"):
    return
  if cfg.every < 0:
    raise ValueError(f"eval_gate.every={cfg.every} must be >= 0 (0: off)")
  if cfg.suite not in suites.SUITES:
    raise ValueError(f"eval_gate.suite={cfg.suite!r} must be one of {sorted(suites.SUITES)}")
  if cfg.limit is not None and cfg.limit < 1:
    raise ValueError(f"eval_gate.limit={cfg.limit} must be >= 1")
  if cfg.max_new_tokens < 1:
    raise ValueError(f"eval_gate.max_new_tokens={cfg.max_new_tokens} must be >= 1")
  if cfg.baseline:
    gate.load_report(cfg.baseline)  # exists and is a report
  if cfg.judge and not os.path.exists(cfg.judge):
    raise ValueError(f"eval_gate.judge={cfg.judge} does not exist")
  gate.parse_max_drop(cfg.max_drop)
  check_protected(cfg.suite, decontam_cfg)
  if task_name == "rm":
    raise ValueError("eval_gate: a reward model does not generate; gate the policy instead")
  if arch not in GENERATING_ARCHS:
    raise ValueError(f"eval_gate: a model of arch {arch!r} does not chat; the evaluation "
                     f"suites need one of {GENERATING_ARCHS}")
  if process_count > 1:
    raise ValueError("eval_gate runs in single-process runs only (its generation is local)")


def make_gate(config) -> "PromotionGate | None":
  """The evaluation gate of `config.eval_gate` for train(gate=...); None when it is off."""
  return PromotionGate(config) if gate_configured(config) else None


class PromotionGate:
  """The loop's hook (train/gate.py): validates config.eval_gate, then starts a Promoter."""

  def __init__(self, config):
    self.config, self.cfg = config, config.eval_gate

  def validate(self, task) -> None:
    if not hasattr(task, "eval_model"):
      raise ValueError(f"eval_gate: the {task.name} task has no generating model to evaluate")
    validate(self.cfg, jax.process_count(), self.config.data.get("decontam"),
             task_name=task.name, arch=self.config.model.arch)

  def start(self, workdir: str, plan, model, start_step: int) -> "Promoter":
    return Promoter(self.cfg, workdir, plan, model, start_step)


def _frozen_copy(model):
  """The model with its own copy of every array: the training step donates the originals."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), state))


class Promoter:
  """A started gate (train/gate.py GateRun): evaluates, gates and promotes (module docstring)."""

  def __init__(self, cfg, workdir: str, plan, model_at_start, start_step: int):
    self.cfg, self.workdir, self.plan = cfg, workdir, plan
    self.root = os.path.join(workdir, "evals")
    self.judge = None
    if "helpful" in suites.SUITES[cfg.suite]:
      if cfg.judge:
        self.judge = judge_for(cfg.judge, None)
        self.judge.name = os.path.basename(os.path.normpath(cfg.judge))
      elif plan.tokenizer.chat_template:
        self.judge = self._starting_judge(model_at_start, start_step)
    self.baseline = cfg.baseline or os.path.join(self.root, "step_0", "report.json")
    if not os.path.exists(self.baseline):
      if start_step:
        raise ValueError(f"eval_gate has no baseline: {self.baseline} is missing and the run "
                         f"resumes at step {start_step}; set eval_gate.baseline")
      self._evaluate(model_at_start, 0)
    else:
      self._check_judge(gate.load_report(self.baseline))
    # the tolerances must name dimensions or metrics of the baseline
    gate.check_tolerances(gate.load_report(self.baseline), gate.parse_max_drop(cfg.max_drop))

  def _starting_judge(self, model_at_start, start_step: int):
    """The default judge: the model the run started from. A fresh run saves it to
    WORKDIR/evals/judge/; a resumed run loads it from there, since its own starting model
    is the restored one and a different judge would void every comparison with step 0."""
    saved = os.path.join(self.root, JUDGE_DIR)
    if start_step and is_workdir(saved):
      judge = judge_for(saved, None)
      judge.name = "the model at step 0"
      return judge
    copy = _frozen_copy(model_at_start)
    if not start_step:
      shutil.rmtree(saved, ignore_errors=True)
      save_model(saved, self.plan.model_cfg, self.plan.tokenizer, nnx.state(copy, nnx.Param),
                 0)
    judge = judge_for(None, _Chat(copy, self.plan.tokenizer))
    judge.name = f"the model at step {start_step}"
    return judge

  def _check_judge(self, baseline: dict) -> None:
    """Refuses, before training, a baseline whose win rates another judge scored: every
    gated step would be refused (align/evals/judges.py)."""
    if self.judge is None:
      return
    mine = {"judge": judges.judge_record(self.judge, self.judge.name, None),
            "metrics": baseline["metrics"]}
    why = judges.reason(baseline, mine)
    if why:
      raise ValueError(f"eval_gate: {why}: the baseline {self.baseline} was judged by "
                       f"{judges.describe(baseline)}, this run's judge is "
                       f"{judges.describe(mine)}; set eval_gate.judge to the baseline's judge, "
                       "or make the baseline with this run's judge")

  def due(self, step: int, last: int) -> bool:
    return bool(self.cfg.every) and (step % self.cfg.every == 0 or step == last)

  def _evaluate(self, model, step: int) -> tuple[dict, str]:
    out = os.path.join(self.root, f"step_{step}")
    report = suites.evaluate_model(model, self.plan.tokenizer, self.cfg.suite, out,
                                limit=self.cfg.limit, seed=self.cfg.seed, judge=self.judge,
                                model_info={"workdir": portable_path(self.workdir), "step": step},
                                max_new_tokens=self.cfg.max_new_tokens)
    return report, os.path.join(out, "report.json")

  def check(self, step: int, model) -> dict:
    """Evaluates `model` (the step's), gates it, and promotes it if it passed."""
    report, path = self._evaluate(model, step)
    try:
      result = gate.compare(gate.load_report(self.baseline), report,
                            gate.parse_max_drop(self.cfg.max_drop))
    except (gate.JudgeRefused, gate.NothingCompared) as e:  # e.g. the step's weights equal
      # the judge's: not promoted
      result = {"passed": False, "checks": [],
                "failures": [{"metric": "judge", "status": "failed", "why": str(e)}]}
    result.update(step=step, report=path, baseline=self.baseline)
    gate.write_json(os.path.join(os.path.dirname(path), "gate.json"), result)
    if result["passed"]:
      self._promote(step, model, path)
      print(f"meshlm: step {step} passed the evaluation gate; promoted to "
            f"{os.path.join(self.workdir, 'promoted')}", flush=True)
    else:
      why = "; ".join(f"{c['metric']}: {c['why']}" for c in result["failures"])
      print(f"meshlm: step {step} NOT promoted: failed the evaluation gate ({why})", flush=True)
    return result

  def _promote(self, step: int, model, report_path: str) -> None:
    """WORKDIR/promoted/ <- the model (written aside, then swapped in), promoted.json."""
    final = os.path.join(self.workdir, "promoted")
    tmp, old = final + ".tmp", final + ".old"
    for d in (tmp, old):
      shutil.rmtree(d, ignore_errors=True)
    save_model(tmp, self.plan.model_cfg, self.plan.tokenizer, nnx.state(model, nnx.Param), step)
    if os.path.exists(final):
      os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    gate.write_json(os.path.join(self.workdir, "promoted.json"),
                    {"step": step, "model": final, "report": report_path,
                     "baseline": self.baseline})


class _Chat:
  """What helpful.judge_for reads of a chat model: .model and .tokenizer."""

  def __init__(self, model, tokenizer):
    self.model, self.tokenizer = model, tokenizer
