"""`meshlm`: train, align, evaluate and serve language models. `meshlm COMMAND --help` lists a
command's flags.

Flag names are spelled with underscores (--max_new_tokens); the dash spelling
(--max-new-tokens) is accepted too. Bad command lines exit with status 2.
"""

import importlib
import sys

from cli.parsing import HELP_ARGS, UsageError, print_error

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


def usage() -> str:
  """The top-level help: every command with its one-line description."""
  width = max(map(len, COMMANDS))
  lines = [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
  return (f"usage: meshlm COMMAND [flags]\n\n{__doc__.strip()}\n\ncommands:\n"
          + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int | None:
  """Runs `meshlm ARGV`; returns the exit status (None: 0)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in HELP_ARGS:
    print(usage(), end="")
    return 0
  if argv[0] not in COMMANDS:
    print_error(f"meshlm: unknown command {argv[0]!r}\n\n{usage()}")
    return USAGE_EXIT
  # Loaded with the command, like it: the `parallel` package imports JAX (~2 s of CPU), which
  # --help and an unknown command do without. Applied before any JAX backend starts.
  importlib.import_module("parallel.xla_flags").apply_overlap_flags()
  module = importlib.import_module(COMMANDS[argv[0]][0])
  try:
    return module.main(argv[1:], argv[0])
  except UsageError as e:  # exits silently with status 2: say why first
    print_error(str(e))
    raise


if __name__ == "__main__":
  sys.exit(main())
