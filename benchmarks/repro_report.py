"""The committed record of a reproduction run (experiments/repro/): one JSON document and
one plot from its workdir, so docs/results.md's tables rest on files in the repository.

  python -m benchmarks.repro_report --config experiments/repro/rm.py:smollm2 \\
      --workdir runs/repro/rm_smollm2 [--eval NAME=FILE.json ...] [--set KEY=VALUE ...] \\
      --out docs/results/repro/rm_smollm2.json --plot docs/img/repro_rm_smollm2.png

Reads WORKDIR/metrics.jsonl (the training curve and the held-out evaluations),
goodput.json (wall time) and data_report_*.json (what fitted), and the config (steps,
batch, sequence length: the token slots a run processed, padding included). `--eval`
embeds the JSON of a separate held-out evaluation of the run (benchmarks/arith_baseline.py,
benchmarks/rm_winrate.py) under NAME. `--set KEY=VALUE` repeats a `--config.KEY=VALUE` the
run was given (a Python literal; a bare word is a string). The plot: the training loss and the method's
headline training metric by step (each log and a moving average of SMOOTH logs), with the
held-out metric at each evaluation.
"""

import argparse
import ast
import importlib
import json
import os
import sys

from train.report_paths import scrub_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method: (headline training metric, held-out metric, its interval keys or None, rows a row)
HEADLINES = {
  "rm": ("accuracy", "val_accuracy", ("val_accuracy_ci_low", "val_accuracy_ci_high"), 2),
  "dpo": ("rewards/accuracies", "val_rewards/accuracies",
          ("val_rewards/accuracies_ci_low", "val_rewards/accuracies_ci_high"), 2),
  "grpo": ("reward", "val_reward", None, 1),
  "ppo": ("reward", "val_reward", None, 1),
}

SMOOTH = 8  # logs in the plot's moving average
CURVE = ("kl", "val_kl", "zero_std_groups", "completion_length", "val_length")  # where logged


def load_config(spec: str):
  """The ConfigDict of `experiments/repro/METHOD.py:VARIANT` and the method's name."""
  path, _, variant = spec.partition(":")
  method = os.path.splitext(os.path.basename(path))[0]
  if method not in HEADLINES or os.path.dirname(os.path.normpath(path)) != \
      os.path.join("experiments", "repro"):
    sys.exit(f"repro_report: --config {spec}: expected experiments/repro/{{"
             f"{','.join(HEADLINES)}}}.py[:VARIANT]")
  module = importlib.import_module(f"experiments.repro.{method}")
  return module.get_config(variant or "paper"), method


def read_json(path: str):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def read_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    sys.exit(f"repro_report: {workdir} has no metrics.jsonl; is it a finished run's workdir?")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(config, method: str, workdir: str, command: str, evals: dict) -> dict:
  train_key, val_key, ci_keys, rows_per_example = HEADLINES[method]
  records = read_records(workdir)
  vals = [r for r in records if val_key in r]
  if not vals:
    sys.exit(f"repro_report: {workdir}/metrics.jsonl holds no {val_key}: the run has not "
             "been evaluated (it evaluates at its last step)")
  last = vals[-1]
  if last["step"] != config.steps:
    sys.exit(f"repro_report: {workdir} was last evaluated at step {last['step']}, not at "
             f"its config's {config.steps}: an unfinished run, or another config")
  goodput = read_json(os.path.join(workdir, "goodput.json"))
  data = {split: read_json(os.path.join(workdir, f"data_report_{split}.json"))
          for split in ("train", "validation")
          if os.path.exists(os.path.join(workdir, f"data_report_{split}.json"))}
  held_out = {k: v for k, v in last.items() if k.startswith("val_")}
  if ci_keys:
    held_out["ci95"] = [last[ci_keys[0]], last[ci_keys[1]]]
  return {
    "method": method, "command": command, "steps": config.steps,
    "batch_size": config.batch_size, "seq_len": config.seq_len,
    "token_slots": config.steps * config.batch_size * rows_per_example * config.seq_len,
    "wall_seconds": round(goodput["total_seconds"], 1), "goodput": goodput,
    "held_out": held_out, "headline": {"train": train_key, "held_out": val_key},
    "curve": [{"step": r["step"], **{k: r[k] for k in (train_key, "loss", val_key) + CURVE
                                     if k in r}} for r in records],
    "data": data, "evaluations": evals}


def moving_average(values, window: int) -> list[float]:
  """The mean of each value and up to window - 1 before it: the logs of a small batch are noisy."""
  return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
          for i in range(len(values))]


def plot(summary: dict, path: str) -> None:
  import matplotlib  # a plot only where asked for

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train_key, val_key = summary["headline"]["train"], summary["headline"]["held_out"]
  curve = summary["curve"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
  for ax, key in zip(axes, ("loss", train_key)):
    steps, values = zip(*[(r["step"], r[key]) for r in curve if key in r])
    ax.plot(steps, values, ".", alpha=0.35, label=f"train {key} (each log)")
    ax.plot(steps, moving_average(values, SMOOTH), label=f"mean of {SMOOTH} logs")
    ax.set_xlabel("step")
    ax.set_title(key)
    ax.legend(fontsize=8)
  held = [(r["step"], r[val_key]) for r in curve if val_key in r]
  axes[1].plot(*zip(*held), "o", color="C3", label=f"held-out {val_key}")
  axes[1].legend(fontsize=8)
  fig.suptitle(f"{summary['method']}: {summary['command']}", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", required=True, help="experiments/repro/METHOD.py[:VARIANT]")
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--eval", action="append", default=[], metavar="NAME=FILE.json")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="a --config.KEY=VALUE override the run was given")
  ap.add_argument("--out", required=True)
  ap.add_argument("--plot", default="")
  args = ap.parse_args(argv)
  config, method = load_config(args.config)
  overrides = {}
  for item in args.set:
    key, sep, value = item.partition("=")
    if not sep:
      sys.exit(f"repro_report: --set {item}: expected KEY=VALUE")
    try:
      overrides[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      overrides[key] = value
  try:
    config.update_from_flattened_dict(overrides)
  except (KeyError, TypeError, ValueError) as e:
    sys.exit(f"repro_report: --set: {e}")
  evals = {}
  for item in args.eval:
    name, sep, path = item.partition("=")
    if not sep or not os.path.exists(path):
      sys.exit(f"repro_report: --eval {item}: expected NAME=FILE.json of an existing file")
    evals[name] = read_json(path)
  workdir = os.path.relpath(os.path.abspath(args.workdir), REPO)
  command = " ".join([f"meshlm {method} --config {args.config} --workdir {workdir}"] +
                     [f"--config.{item}" for item in args.set])
  summary = scrub_paths(summarize(config, method, args.workdir, command, evals))
  if args.plot:
    plot(summary, args.plot)
    summary["plot"] = os.path.relpath(os.path.abspath(args.plot), REPO)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".tmp", "w", encoding="utf-8") as f:
    f.write(json.dumps(summary, indent=1) + "\n")
  os.replace(args.out + ".tmp", args.out)  # nothing half-written
  print(json.dumps({k: summary[k] for k in ("method", "command", "wall_seconds", "held_out")},
                   indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
