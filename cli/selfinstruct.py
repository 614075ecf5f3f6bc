"""`meshlm selfinstruct`: Self-Instruct (Wang et al. 2022) with a meshlm model.

  meshlm selfinstruct --config experiments/selfinstruct.py --out DIR [--config.KEY=VALUE ...]

The stages, their files in DIR and how a killed run resumes: align/curate/selfinstruct.py.
"""

import json
import time

from absl import flags
from ml_collections import config_flags

from align.curate.selfinstruct import run
from cli.parsing import parse, require


def make_flags(argv: list[str]) -> flags.FlagValues:
  """The flags; `argv` (after `selfinstruct`) names the --config.KEY overrides."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Self-Instruct config file "
                                  "(experiments/selfinstruct.py)", flag_values=fv,
                                  lock_config=True, sys_argv=["meshlm"] + list(argv))
  flags.DEFINE_string("out", None, "output directory (stage logs, stats.json, the asset)",
                      flag_values=fv)
  return fv


def _log(message: str) -> None:
  print(f"[selfinstruct {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str], command: str = "selfinstruct") -> None:
  """`meshlm selfinstruct ARGS`: argv is everything after `selfinstruct`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "config", "out")
  try:
    stats = run(fv["config"].value, fv["out"].value, log=_log)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  print(json.dumps(stats, indent=2))
