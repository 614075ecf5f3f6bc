"""`meshlm data`: inspect data assets (train/assets.py).

  meshlm data ls ROOT                 every asset version under ROOT: name, version, kind, rows,
                                      created, short content hash
  meshlm data show PATH [--rows N]    a version's manifest (lineage included) and first N rows
                                      (PATH: a version dir, or ROOT/NAME for the latest)
  meshlm data diff PATH_A PATH_B      manifest differences (lineage, rows, hash, columns) and
                                      rows added / removed, by row hash, with examples
  meshlm data register PATH [--name N] [--registry FILE]
                                      protect an asset of kind "eval" (e.g. a pair run's
                                      held-out prompts_eval): training runs then refuse data
                                      overlapping it (train/decontam.py)
  meshlm data decontam SRC ROOT [--name N] [--eval_sets S] [--registry FILE]
                                      write the rows of the JSONL(.gz) training file SRC that
                                      share no 13-gram with the protected evaluation sets as
                                      asset ROOT/N/vK (default N: SRC's name + "-decontam");
                                      its manifest counts the rows dropped ("decontaminated")
"""

import os
import sys

from absl import flags

from train.asset_inspect import print_diff, print_list, print_show
from train.decontam import write_decontaminated
from train.eval_registry import REGISTRY, register_asset
from cli.parsing import UsageError, parse

# Each action's positional words and the flags that apply to it.
ACTIONS = {"ls": (("ROOT",), ()), "show": (("PATH",), ("rows",)),
           "diff": (("PATH_A", "PATH_B"), ()), "register": (("PATH",), ("name", "registry")),
           "decontam": (("SRC", "ROOT"), ("name", "eval_sets", "registry"))}


def stem(path: str) -> str:
  """The file's name less its data extensions: helpful-base-test.v2.jsonl.gz -> ...-test.v2."""
  name = os.path.basename(path)
  for ext in (".gz", ".jsonl", ".json"):
    name = name.removesuffix(ext)
  return name


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_integer("rows", 5, "show: rows to print", flag_values=fv)
  flags.DEFINE_string("name", None, "register: the name to protect it under (default: the "
                      "asset's)", flag_values=fv)
  flags.DEFINE_string("registry", None, "register, decontam: the registry file (default: "
                      "data/protected_evals.json)", flag_values=fv)
  flags.DEFINE_string("eval_sets", "default", "decontam: the evaluation sets to drop overlaps "
                      "with (registry names, asset dirs, comma-separated; default: all "
                      "registered)", flag_values=fv)
  return fv


def _action(command: str, words: list[str], fv) -> tuple[str, list[str]]:
  """(action, its positional words), checked: the arity, and no flag of another action."""
  choices = ", ".join(ACTIONS)
  if not words:
    raise UsageError(f"meshlm {command}: name an action: {choices} (meshlm {command} --help)")
  action, args = words[0], words[1:]
  if action not in ACTIONS:
    raise UsageError(f"meshlm {command}: unknown action {action!r}; choose one of {choices}")
  names, own = ACTIONS[action]
  if len(args) != len(names):
    raise UsageError(f"meshlm {command} {action}: takes {' '.join(names)}, got {len(args)} "
                     f"argument(s): {args}")
  misplaced = [f"--{n}" for n in ("rows", "name", "registry", "eval_sets")
               if fv[n].present and n not in own]
  if misplaced:
    raise UsageError(f"meshlm {command} {action}: {', '.join(misplaced)} does not apply to "
                     f"{action}")
  return action, args


def main(argv: list[str], command: str = "data") -> None:
  """`meshlm data ACTION ARGS`: argv is everything after `data`."""
  fv = make_flags(argv)
  action, args = _action(command, parse(command, argv, fv, __doc__, positional=True), fv)
  missing = [a for a in args[:1 if action in ("register", "decontam") else 2]
             if not os.path.exists(a)]
  if missing:  # not "no assets": a typo must not read as an empty store
    raise UsageError(f"meshlm {command} {action}: {missing[0]} does not exist")
  try:
    if action == "ls":
      print_list(args[0], sys.stdout)
    elif action == "show":
      print_show(args[0], fv["rows"].value, sys.stdout)
    elif action == "diff":
      print_diff(args[0], args[1], sys.stdout)
    elif action == "register":
      registry = fv["registry"].value or REGISTRY
      entry = register_asset(args[0], name=fv["name"].value, registry=registry)
      print(f"registered {entry['name']!r} ({entry['asset']}) in {registry}")
    else:
      src, root = args
      name = fv["name"].value or stem(src) + "-decontam"
      vdir = write_decontaminated(src, root, name, eval_sets=fv["eval_sets"].value,
                                  registry=fv["registry"].value or REGISTRY)
      print_show(vdir, 0, sys.stdout)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command} {action}: {e}") from None
