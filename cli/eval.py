"""`meshlm eval`: run an evaluation suite on a model and write its reports.

    meshlm eval --model PATH --suite hhh|helpful|harmless|honest|redteam --out DIR
                [--limit N] [--judge PATH] [--seed 0] [--max_new_tokens 128]
                [--batch_size 8]

PATH is anything `meshlm generate` loads (a workdir, an HF directory, a .gguf file).
`hhh` runs helpful, harmless and honest; `redteam` runs the attack library
(align/evals/attacks.py). `--limit N` takes the first N valid rows of every dataset.
`--judge` is the helpfulness judge. Without it the evaluated model judges its own answers:
the report says so (report["judge"]["self"]), and `meshlm gate` will not compare those win
rates. For reports you will gate, pass one fixed --judge to all of them.

DIR receives report.json (every metric: value, n, bootstrap 95% CI), report.html (one
self-contained page with plots) and responses.jsonl (every answer, for audit); the same
model, suite, limit and seed give a byte-identical report.json (align/evals/suites.py).
The report names the model by a path that holds on any machine: relative to the current
directory, or `<packages>/PKG/...`, `~/...`, `<tmp>/...` (train/report_paths.py).
Exit status 2 on unusable input.
"""

import os

from absl import flags

from align.evals.helpful import judge_for
from align.evals.suites import SUITES, evaluate_model, fingerprint
from cli.parsing import UsageError, parse, print_error, require, require_paths
from infer.loading import load_any
from train.report_paths import portable_path

EXIT_BAD_INPUT = 2


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "the model to evaluate (workdir, HF directory, .gguf)",
                      flag_values=fv)
  flags.DEFINE_enum("suite", None, sorted(SUITES), "the suite to run", flag_values=fv)
  flags.DEFINE_string("out", None, "output directory for report.json, report.html and "
                      "responses.jsonl", flag_values=fv)
  flags.DEFINE_integer("limit", None, "the first N valid rows of every dataset (default: all)",
                       flag_values=fv)
  flags.DEFINE_string("judge", None, "helpfulness judge checkpoint, the same for every report "
                      "you will gate (default: the evaluated model judges itself, and the gate "
                      "will not compare its win rates)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "seed of the bootstrap and any sampling", flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 128, "answer length in tokens", flag_values=fv)
  flags.DEFINE_integer("batch_size", 8, "prompts per generation batch", flag_values=fv)
  return fv


def skipped_lines(report: dict) -> list[str]:
  """What the suite left out and why, a line per dataset or metric and reason (report.json's
  `skipped`), so that a score over fewer metrics or rows says so on the screen."""
  lines = []
  for where, reasons in sorted((report.get("skipped") or {}).items()):
    for reason, count in sorted((reasons or {}).items()):
      if count:
        lines.append(f"{where}: {reason}" + (f" ({count} rows)" if count > 1 else ""))
  return lines


def main(argv: list[str], command: str = "eval") -> int:
  """`meshlm eval ARGS`: argv is everything after `eval`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "model", "suite", "out")
  model_path, out, batch_size = fv["model"].value, fv["out"].value, fv["batch_size"].value
  for name in ("limit", "batch_size", "max_new_tokens"):
    if fv[name].value is not None and fv[name].value < 1:
      raise UsageError(f"meshlm {command}: --{name}={fv[name].value} must be >= 1")
  require_paths(command, fv, "model", "judge")
  try:
    model, tokenizer = load_any(model_path)
    judge, suite = None, fv["suite"].value
    if fv["judge"].value and not os.path.exists(fv["judge"].value):
      raise FileNotFoundError(f"--judge {fv['judge'].value} does not exist")
    if fv["judge"].value and "helpful" in SUITES[suite]:  # only the win rates are judged
      judge = judge_for(fv["judge"].value, None, batch_size=batch_size)
      judge.name = os.path.basename(os.path.normpath(fv["judge"].value))
    info = {"path": portable_path(model_path),
            "name": os.path.basename(os.path.normpath(model_path)),
            "fingerprint": fingerprint(model_path)}
    report = evaluate_model(model, tokenizer, suite, out, limit=fv["limit"].value,
                            seed=fv["seed"].value, judge=judge, model_info=info,
                            max_new_tokens=fv["max_new_tokens"].value, batch_size=batch_size)
  except (ValueError, FileNotFoundError) as e:
    print_error(f"meshlm {command}: error: {e}")
    return EXIT_BAD_INPUT
  for dim, d in report["dimensions"].items():
    print(f"{dim}: score {d['score']:.3f} over {len(d['metrics'])} metrics")
  for line in skipped_lines(report):
    print(f"meshlm {command}: skipped {line}")
  if (report["judge"] or {}).get("self"):
    print(f"meshlm {command}: note: the evaluated model judged its own answers; `meshlm gate` "
          "compares these win rates only as a baseline's, against candidates judged by this "
          "model (a candidate needs a --judge that is not itself)")
  print(f"meshlm {command}: wrote {os.path.join(out, 'report.json')} and report.html")
  return 0
