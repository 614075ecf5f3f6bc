"""What every `meshlm` subcommand shares: absl flag parsing with dash aliases, -h/--help from
absl's own flag help, and usage errors that name the flag.

Flag names are spelled with underscores (--max_new_tokens); --max-new-tokens is accepted as
an alias: only the name part of a flag is rewritten, never a value, a positional word,
anything after `--`, or a --config.KEY override.
"""

import os
import sys

from absl import flags
from ml_collections import ConfigDict

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
    raise UsageError(f"meshlm {command}: {parse_error(e)} (meshlm {command} --help lists "
                     "the flags)") from None
  # Config overrides fail at parse time: an unknown key (AttributeError, KeyError) or a value
  # of the wrong type (ValueError).
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    raise UsageError(f"meshlm {command}: {parse_error(e, config_path(argv))}") from None
  except Exception as e:  # the config file itself: a syntax error, an import, get_config
    if config_path(argv) is None:
      raise
    raise UsageError(f"meshlm {command}: config file {config_path(argv)}: "
                     f"{type(e).__name__}: {first_line(e)}") from None
  if "config" in fv and fv["config"].present:
    check_config(command, fv, argv)
  if words and not positional:
    raise UsageError(f"meshlm {command}: unexpected argument {words[0]!r} (flags are "
                     f"--name=value; meshlm {command} --help lists them)")
  return words


def first_line(e: BaseException) -> str:
  """The first line of an exception's message ("" for none)."""
  text = str(e).strip()
  return text.splitlines()[0] if text else ""


def parse_error(e: BaseException, config_file: str | None = None) -> str:
  """A flag or config-override error as one line without Python's quoting: an unknown config
  key (a KeyError inside an AttributeError) reads `unknown config key 'stepz' (did you mean
  "steps" instead of "stepz"?)`; a config file that failed to load, its own last words."""
  text = str(e)
  if "Error whilst parsing config file" in text:  # ml_collections quotes the traceback
    last = [line.strip() for line in text.splitlines() if line.strip()][-1]
    return f"config file {config_file}: {last}"
  if "has no attribute 'get_config'" in text:
    return f"config file {config_file} defines no get_config()"
  inner = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
  if isinstance(inner, KeyError):
    text = str(inner.args[0]) if inner.args else ""
    key, _, hint = text.partition("\n")
    hint = hint.strip()
    return (f"unknown config key {key}"
            + (f" ({hint[:1].lower() + hint[1:]})" if hint else ""))
  text = " ".join(str(e).split())
  return text[1:-1] if len(text) > 1 and text[0] == text[-1] == "'" else text


def check_config(command: str, fv: flags.FlagValues, argv: list[str]) -> None:
  """UsageError where the config file's get_config gave something other than a ConfigDict."""
  value = fv["config"].value
  if not isinstance(value, ConfigDict):
    raise UsageError(f"meshlm {command}: config file {config_path(argv)}: get_config() "
                     f"returned a {type(value).__name__}, not an ml_collections.ConfigDict")


def config_path(argv: list[str]) -> str | None:
  """The value of --config in `argv` (either spelling), or None."""
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return None


def require(command: str, fv: flags.FlagValues, *names: str) -> None:
  """UsageError naming the flags among `names` that were not given."""
  missing = ["--" + n for n in names if fv[n].value is None]
  if missing:
    plural = "s" if len(missing) > 1 else ""
    raise UsageError(f"meshlm {command}: missing required flag{plural} {', '.join(missing)}")


def require_paths(command: str, fv: flags.FlagValues, *names: str) -> None:
  """UsageError naming the first of the flags `names` whose value is a path that does not
  exist (an unset flag is `require`'s business)."""
  for name in names:
    value = fv[name].value
    if value and not os.path.exists(value):
      raise UsageError(f"meshlm {command}: --{name} {value} does not exist")


def print_error(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
