"""The evaluation gate: a hook train() calls at fixed points, so the loop runs one without
knowing what it evaluates. align/evals/promote.py implements it (make_gate(config) builds
one from config.eval_gate); the caller builds it and passes it to train(gate=...).

  gate.validate(task)            raises ValueError if it cannot run on `task`; called before
                                 the workdir is written
  gate.start(workdir, plan, model, start_step) -> GateRun
                                 at the run's start (after any restore), from the starting
                                 model: e.g. evaluates it as the baseline
  run.due(step, steps)           whether step `step` of `steps` is gated (the loop then
                                 checkpoints it, whatever checkpoint_every says)
  run.check(step, model)         evaluates the step's model after its checkpoint is written
                                 (promoting it if it passes)

The loop times start and check as evaluation (goodput "eval") and calls both under the
run's mesh and sharding rules.
"""

from typing import Protocol


class GateRun(Protocol):
  """A gate started on one run."""

  def due(self, step: int, steps: int) -> bool: ...

  def check(self, step: int, model) -> dict: ...


class EvalGate(Protocol):
  """What train(gate=...) takes."""

  def validate(self, task) -> None: ...

  def start(self, workdir: str, plan, model, start_step: int) -> GateRun: ...


def gate_configured(config) -> bool:
  """Whether `config` asks for an evaluation gate (config.eval_gate.every set)."""
  gate_cfg = config.get("eval_gate")
  return bool(gate_cfg and gate_cfg.get("every"))
