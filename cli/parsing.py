"""What every `meshlm` subcommand shares: absl flag parsing with dash aliases, -h/--help from
absl's own flag help, and usage errors that name the flag.

Flag names are spelled with underscores (--max_new_tokens); --max-new-tokens is accepted as
an alias: only the name part of a flag is rewritten, never a value, a positional word,
anything after `--`, or a --config.KEY override.
"""

import sys

from absl import flags

HELP_ARGS = ("-h", "--help", "-help", "--helpfull", "--helpshort")
USAGE_EXIT = 2  # bad command line (argparse's convention; `meshlm gate` reserves 1 for "regressed")


class UsageError(SystemExit):
  """A bad command line: exits with status 2; str(e) is the message for stderr.

  A SystemExit whose code is an int exits silently, so `cli.main.main` prints the message;
  code that calls a subcommand's main directly sees it in the exception."""

  def __init__(self, message: str):
    super().__init__(USAGE_EXIT)
    self.message = message

  def __str__(self) -> str:
    return self.message


def _split_flag(arg: str):
  """(prefix, name, rest) of a flag argument ("--max-new-tokens=5" -> "--", "max-new-tokens",
  "=5"), or None for a value or positional word ("5", "-0.5", "-")."""
  prefix = "--" if arg.startswith("--") else "-" if arg.startswith("-") else ""
  body = arg[len(prefix):]
  if not prefix or not body[:1].isalpha():
    return None
  name, eq, value = body.partition("=")
  return prefix, name, eq + value


def _is_boolean(fv: flags.FlagValues, name: str) -> bool:
  return name in fv and fv[name].boolean


def _takes_value(fv: flags.FlagValues, name: str) -> bool:
  """Whether `--name` without "=" consumes the next argument as its value."""
  return name in fv and not fv[name].boolean


def normalize(argv: list[str], fv: flags.FlagValues) -> tuple[list[str], bool]:
  """(argv with dash aliases spelled with underscores, whether help was asked for)."""
  out, wants_help, skip_value = [], False, False
  for i, arg in enumerate(argv):
    if skip_value:  # the value of the flag before it, whatever it looks like
      out.append(arg)
      skip_value = False
      continue
    if arg == "--":  # absl: everything after it is positional
      return out + argv[i:], wants_help
    parts = _split_flag(arg)
    if parts is None:
      out.append(arg)
      continue
    prefix, name, rest = parts
    if arg in HELP_ARGS:
      wants_help = True
    if not name.startswith("config."):  # config keys are the config's own business
      name = name.replace("-", "_")
      if name.startswith("no_") and name not in fv and _is_boolean(fv, name[3:]):
        name = "no" + name[3:]  # --no-chat: absl spells a false boolean --nochat
    skip_value = not rest and _takes_value(fv, name)
    out.append(prefix + name + rest)
  return out, wants_help


def help_text(command: str, fv: flags.FlagValues, doc: str) -> str:
  """The command's usage (its module docstring) and absl's help for each of its flags."""
  flag_help = fv.get_help(include_special_flags=False).strip("\n")
  return (f"{doc.strip()}\n\nflags of `meshlm {command}` (a dash spelling such as "
          f"--foo-bar is accepted for --foo_bar):\n\n{flag_help}\n")


def parse(command: str, argv: list[str], fv: flags.FlagValues, doc: str,
          positional: bool = False) -> list[str]:
  """Parses `argv` (what follows the subcommand) into `fv`; returns the positional words.

  -h/--help prints help_text and exits 0; a bad flag or value raises UsageError naming it."""
  argv, wants_help = normalize(list(argv), fv)
  if wants_help:
    print(help_text(command, fv, doc), end="")
    raise SystemExit(0)
  try:
    words = fv([f"meshlm {command}"] + argv)[1:]
  except flags.UnrecognizedFlagError as e:
    raise UsageError(f"meshlm {command}: {str(e).strip(chr(39))} (meshlm {command} --help "
                     "lists the flags)") from None
  # Config overrides fail at parse time: an unknown key (AttributeError, KeyError) or a value
  # of the wrong type (ValueError).
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    raise UsageError(f"meshlm {command}: {str(e).strip(chr(39))}") from None
  if words and not positional:
    raise UsageError(f"meshlm {command}: unexpected argument {words[0]!r} (flags are "
                     f"--name=value; meshlm {command} --help lists them)")
  return words


def require(command: str, fv: flags.FlagValues, *names: str) -> None:
  """UsageError naming the flags among `names` that were not given."""
  missing = ["--" + n for n in names if fv[n].value is None]
  if missing:
    plural = "s" if len(missing) > 1 else ""
    raise UsageError(f"meshlm {command}: missing required flag{plural} {', '.join(missing)}")


def print_error(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
