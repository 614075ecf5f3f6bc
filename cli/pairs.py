"""`meshlm pairs`: preference pairs judged by a teacher, with human review and audit.

  meshlm pairs --config experiments/pairs_hh.py --workdir runs/pairs_hh [--config.KEY=VALUE ...]
  meshlm pairs --config experiments/pairs_hh.py --workdir runs/pairs_hh --publish_only

A killed run resumes from WORKDIR's journal; the queue is reviewed with
`meshlm review --db WORKDIR/review.sqlite`. How pairs are built: align/curate/pairs.py.
"""

import json

from absl import flags
from ml_collections import config_flags

from align.curate.pairs import Builder
from cli.parsing import parse, require


def make_flags(argv: list[str]) -> flags.FlagValues:
  """The flags; `argv` (after `pairs`) names the --config.KEY overrides."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "pairs config (experiments/pairs_hh.py)",
                                  flag_values=fv, lock_config=True,
                                  sys_argv=["meshlm"] + list(argv))
  flags.DEFINE_string("workdir", None, "run directory (journal, queue, assets)", flag_values=fv)
  flags.DEFINE_bool("publish_only", False, "only (re)publish the pairs asset with the queue's "
                    "current human labels", flag_values=fv)
  return fv


def main(argv: list[str], command: str = "pairs") -> None:
  """`meshlm pairs ARGS`: argv is everything after `pairs`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "config", "workdir")
  try:
    builder = Builder(fv["config"].value, fv["workdir"].value)
    with builder.lock():
      stats = builder.publish() if fv["publish_only"].value else builder.run()
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  print(json.dumps(stats, indent=1))
