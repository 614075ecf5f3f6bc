"""`meshlm`: train, align, evaluate and serve language models. `meshlm COMMAND --help` lists a
command's flags.

Flag names are spelled with underscores (--max_new_tokens); the dash spelling
(--max-new-tokens) is accepted too. A failure is reported in one line on stderr
(MESHLM_DEBUG=1 adds the Python traceback), and the exit status says what kind:

  0    done (`meshlm train`: every config.steps taken, or already there)
  1    the run failed: unreadable data, model or checkpoint, or an error while running
       (`meshlm gate`: the candidate regressed)
  2    bad command line, flag value or config, refused before any model loads
  75   `meshlm train` preempted (SIGTERM), checkpointed: restart it
  76   `meshlm train` hung past its watchdog: restart it
  77   `meshlm train` lost a peer process: restart the job
  130  interrupted (Ctrl-C)

Compiled XLA programs are kept in a persistent cache, so a repeated command skips
compiling: ~/.cache/meshlm/jax (under $XDG_CACHE_HOME if set). MESHLM_COMPILATION_CACHE=DIR
moves it, MESHLM_COMPILATION_CACHE=off disables it; JAX_COMPILATION_CACHE_DIR, if set,
wins. JAX keys each entry by the program, the jax/jaxlib versions and the compile flags.
"""

import importlib
import os
import sys
import traceback

from cli.parsing import HELP_ARGS, UsageError, first_line, print_error

# name -> (module, one-line description), in the order `meshlm --help` lists them. The
# modules are imported when their command runs: all of them at once load JAX, the training
# loop and the server (~6 s of CPU), too slow for `meshlm --help` or `meshlm gate`.
COMMANDS = {
    "train": ("cli.train", "pretrain a model on the shared training loop"),
    "sft": ("cli.train", "supervised fine-tuning on chat data (align/sft.py)"),
    "rm": ("cli.train", "train a reward model on preference pairs (align/reward.py)"),
    "dpo": ("cli.train", "direct preference optimisation (align/dpo.py)"),
    "distill": ("cli.train", "distil a teacher into the model (align/distill.py)"),
    "ppo": ("cli.train", "on-policy RL with PPO (align/ppo.py)"),
    "grpo": ("cli.train", "on-policy RL with GRPO (align/grpo.py)"),
    "generate": ("cli.generate", "stream a completion of a prompt"),
    "plan": ("cli.plan", "size a device layout, check it against a compile, suggest others"),
    "quantize": ("cli.quantize", "quantize a model into a checkpoint directory"),
    "embed": ("cli.embed", "sentence embeddings of a file's texts (encoder models)"),
    "pairs": ("cli.pairs", "preference pairs judged by a teacher, with human review"),
    "review": ("cli.review", "the human review page over a review queue"),
    "data": ("cli.data", "inspect data assets: ls, show, diff, register"),
    "selfinstruct": ("cli.selfinstruct", "generate instruction data with Self-Instruct"),
    "eval": ("cli.eval", "run an evaluation suite and write its reports"),
    "gate": ("cli.gate", "compare two evaluation reports: does the candidate regress?"),
    "serve": ("cli.serve", "an OpenAI-compatible server with a canary release"),
}
USAGE_EXIT = 2
FAILED_EXIT = 1
INTERRUPTED_EXIT = 130
DEBUG_ENV = "MESHLM_DEBUG"
CACHE_ENV = "MESHLM_COMPILATION_CACHE"


def usage() -> str:
  """The top-level help: every command with its one-line description."""
  width = max(map(len, COMMANDS))
  lines = [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
  return (f"usage: meshlm COMMAND [flags]\n\n{__doc__.strip()}\n\ncommands:\n"
          + "\n".join(lines) + "\n")


def one_line(e: BaseException) -> str:
  """An exception's message as one line: its first line, with the type where it says more."""
  first = first_line(e)
  if isinstance(e, KeyError) and first[:1] in "'\"":  # KeyError('x') prints as "'x'"
    first = first[1:-1].replace("\\'", "'").replace("\\n", " ")
  if not first or isinstance(e, (SyntaxError, ImportError, TypeError, AttributeError,
                                  KeyError, RuntimeError, ZeroDivisionError)):
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
  return first


def quiet_tpu_probe() -> None:
  """On a host without TPU chips, JAX asks an installed libtpu (the [tpu] and [test] extras
  bring one for deviceless compiles) to look for them, and libtpu prints half a dozen lines
  of warnings before every command. Where no TPU device file exists and JAX_PLATFORMS is
  unset, JAX is told which platforms to start instead."""
  if "JAX_PLATFORMS" in os.environ or os.path.exists("/dev/accel0") or (
      os.path.isdir("/dev/vfio") and any(n.isdigit() for n in os.listdir("/dev/vfio"))):
    return
  if not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"


def compilation_cache_dir() -> str | None:
  """Where the persistent compilation cache lives (module docstring); None: disabled."""
  value = os.environ.get(CACHE_ENV, "").strip()
  if value.lower() in ("0", "off", "false", "no", "none"):
    return None
  if value:
    return os.path.abspath(os.path.expanduser(value))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "meshlm", "jax")


def enable_compilation_cache() -> None:
  """Points JAX (not yet imported) at the persistent cache, every program in it: a decode
  step compiles in well under JAX's default threshold of one second, yet a command runs
  dozens of them."""
  path = compilation_cache_dir()
  if path is None or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def dispatch(argv: list[str]) -> int | None:
  """Runs `meshlm ARGV`, raising what the command raises (UsageError: a bad command line)."""
  if not argv or argv[0] in HELP_ARGS:
    print(usage(), end="")
    return 0
  if argv[0] not in COMMANDS:
    raise UsageError(f"meshlm: unknown command {argv[0]!r}; the commands are "
                     f"{', '.join(COMMANDS)} (meshlm --help describes them)")
  quiet_tpu_probe()
  enable_compilation_cache()
  # Loaded with the command, like it: the `parallel` package imports JAX (~2 s of CPU), which
  # --help and an unknown command do without. Applied before any JAX backend starts.
  importlib.import_module("parallel.xla_flags").apply_overlap_flags()
  module = importlib.import_module(COMMANDS[argv[0]][0])
  return module.main(argv[1:], argv[0])


def main(argv: list[str] | None = None) -> int:
  """`meshlm ARGV` behind the error boundary: every failure becomes one line on stderr and
  an exit status from the module docstring's table; returns that status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  command = f"meshlm {argv[0]}" if argv and argv[0] in COMMANDS else "meshlm"
  try:
    return dispatch(argv) or 0
  except UsageError as e:
    print_error(str(e))
    return USAGE_EXIT
  except SystemExit as e:  # a command's own exit: a status, or a message (status 1)
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    if os.environ.get(DEBUG_ENV) and e.__cause__ is not None:
      traceback.print_exception(e.__cause__)
    print_error(str(e.code))
    return FAILED_EXIT
  except KeyboardInterrupt:
    print_error(f"{command}: interrupted")
    return INTERRUPTED_EXIT
  except Exception as e:  # an unexpected failure: still one line, unless debugging
    if os.environ.get(DEBUG_ENV):
      raise
    print_error(f"{command}: error: {one_line(e)} ({DEBUG_ENV}=1 shows the traceback)")
    return FAILED_EXIT


if __name__ == "__main__":
  sys.exit(main())
