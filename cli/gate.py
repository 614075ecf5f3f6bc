"""`meshlm gate`: does a candidate's evaluation report regress on any dimension?

    meshlm gate --baseline BASE/report.json --candidate NEW/report.json \\
                [--max_drop helpful=0.02,harmless=0.02,honest/truthfulqa_mc1=0.01] [--json FILE]
                [--skip_judged]

A metric fails when it dropped by more than its tolerance and the candidate's whole 95% CI
lies below baseline - tolerance (align/evals/gate.py). Judged metrics (the helpfulness win
rates) are compared only when the same judge weights scored both reports and the candidate
did not judge itself; otherwise the gate refuses and names both judges, and --skip_judged
compares the other metrics only (align/evals/judges.py). Exit status 0: passed;
1: regressed (each failure printed with why); 2: unusable or incomparable reports (judges
included), or a bad command line.
"""

from absl import flags

from align.evals.gate import (DEFAULT_MAX_DROP, EXIT_BAD_INPUT, EXIT_PASS, EXIT_REGRESSED,
                              compare, load_report, parse_max_drop, write_json)
from cli.parsing import parse, print_error, require, require_paths


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_string("baseline", None, "the baseline report.json", flag_values=fv)
  flags.DEFINE_string("candidate", None, "the candidate report.json", flag_values=fv)
  flags.DEFINE_string("max_drop", "", "tolerances, e.g. helpful=0.02,harmless=0.02 (default: "
                      + ",".join(f"{k}={v}" for k, v in DEFAULT_MAX_DROP.items()) + ")",
                      flag_values=fv)
  flags.DEFINE_string("json", None, "also write the verdict to this file", flag_values=fv)
  flags.DEFINE_boolean("skip_judged", False, "skip the judged metrics (win rates) and compare "
                       "the rest, e.g. when the reports had different judges", flag_values=fv)
  return fv


def main(argv: list[str], command: str = "gate") -> int:
  """`meshlm gate ARGS`: argv is everything after `gate`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "baseline", "candidate")
  require_paths(command, fv, "baseline", "candidate")
  try:
    result = compare(load_report(fv["baseline"].value), load_report(fv["candidate"].value),
                     parse_max_drop(fv["max_drop"].value), skip_judged=fv["skip_judged"].value)
  except ValueError as e:
    print_error(f"meshlm {command}: error: {e}")
    return EXIT_BAD_INPUT
  for c in result["checks"]:
    if c["status"] == "skipped":
      print(f"SKIPPED {c['metric']}: {c['why']}")
  for f in result["failures"]:
    print(f"REGRESSED {f['metric']}: {f['why']}")
  passed = sum(c["status"] == "passed" for c in result["checks"])
  print(f"meshlm {command}: {'PASSED' if result['passed'] else 'FAILED'} "
        f"({passed} passed, {len(result['failures'])} failed, "
        f"{sum(c['status'] == 'skipped' for c in result['checks'])} skipped)")
  if fv["json"].value:
    write_json(fv["json"].value, result)
  return EXIT_PASS if result["passed"] else EXIT_REGRESSED
