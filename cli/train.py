"""`meshlm train|sft|rm|dpo|distill|ppo|grpo`: one training loop, the command picks the task.

  meshlm train --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE ...]
  meshlm sft|rm|dpo|distill --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE ...]
                  (alignment on the same loop: align/tasks.py)
  meshlm ppo|grpo (as above: on-policy RL, align/ppo.py, align/grpo.py)

--config FILE.py:ARG passes ARG to the file's get_config. Multi-process runs add
--coordinator_address, --num_processes and --process_id.
"""

import os

import jax
from absl import flags
from ml_collections import config_flags

from align.distill import DistillTask
from align.dpo import DPOTask
from align.evals.promote import make_gate
from align.grpo import GRPOTask
from align.ppo import PPOTask
from align.reward import RewardTask
from align.sft import SFTTask
from cli.parsing import UsageError, config_path, parse, require
from infer import generate
from models import ConfigError
from parallel.distributed import initialize
from train import exit_codes
from train.fault import Preempted
from train.loop import train
from train.watchdog import PeerMonitor
from train.workdir import load_trained

COMMANDS = ("train", "sft", "rm", "dpo", "distill", "ppo", "grpo")
TASKS = {"sft": SFTTask, "rm": RewardTask, "dpo": DPOTask, "distill": DistillTask,
         "ppo": PPOTask, "grpo": GRPOTask}


def make_flags(argv: list[str]) -> flags.FlagValues:
  """The commands' flags; `argv` (after the command) names the --config.KEY overrides."""
  fv = flags.FlagValues()
  # sys_argv: override flags (--config.a.b=v) are discovered from these args.
  config_flags.DEFINE_config_file("config", None, "experiment config file", flag_values=fv,
                                  lock_config=True, sys_argv=["meshlm"] + list(argv))
  flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and logs",
                      flag_values=fv)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process)",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "number of processes (multi-process)",
                       flag_values=fv)
  flags.DEFINE_integer("process_id", None, "this process's id (multi-process)", flag_values=fv)
  return fv


def make_task(command: str, config, workdir: str):
  """None (pretraining: the loop's LMTask) or the alignment task of `command`."""
  if command == "train":
    return None
  return TASKS[command](config, workdir)


def run_train(fv, command: str = "train") -> None:
  config = fv["config"].value
  initialize(fv["coordinator_address"].value, fv["num_processes"].value, fv["process_id"].value)
  # Started before compilation so that start-up is covered too; no-op for one process.
  monitor = PeerMonitor(timeout_s=config.peer_timeout_seconds, poll_s=1.0)
  try:
    last = train(config, fv["workdir"].value, task=make_task(command, config,
                                                             fv["workdir"].value),
                 gate=make_gate(config))
  except Preempted as e:
    print(f"meshlm: {e}", flush=True)
    raise SystemExit(exit_codes.PREEMPTED) from e
  monitor.close()
  if not last:  # the run was already at config.steps: nothing was trained
    return
  print({k: round(v, 4) for k, v in last.items()})
  generates = config.model.arch in ("decoder", "prefix_lm") and command == "train"
  if config.sample.prompt and config.sample.max_new_tokens > 0 and generates:
    if jax.process_index() == 0:
      model, tokenizer, _ = load_trained(fv["workdir"].value)
      ids = generate(model, tokenizer.encode(config.sample.prompt, add_bos=True),
                     config.sample.max_new_tokens, temperature=config.sample.temperature,
                     top_k=config.sample.top_k, seed=config.seed, eos_id=tokenizer.eos_id)
      print("--- sample ---\n" + config.sample.prompt + tokenizer.decode(ids))


def main(argv: list[str], command: str = "train") -> None:
  """`meshlm COMMAND ARGS`: argv is everything after the command."""
  if command not in COMMANDS:
    raise ValueError(f"{command!r} is not one of {COMMANDS}")
  fv = make_flags(argv)
  config_file = config_path(argv)
  if config_file and not os.path.isfile(config_file.split(":")[0]):
    # Before parsing, which would only say that the flag's value could not be loaded.
    raise UsageError(f"meshlm {command}: config file {config_file} does not exist")
  parse(command, argv, fv, __doc__)
  if not fv["config"].present:
    raise UsageError(f"meshlm {command}: missing required flag --config")
  require(command, fv, "workdir")
  if os.path.exists(fv["workdir"].value) and not os.path.isdir(fv["workdir"].value):
    raise UsageError(f"meshlm {command}: --workdir {fv['workdir'].value} is a file, not a "
                     "directory")
  try:
    run_train(fv, command)
  except ConfigError as e:  # a config value, refused before the run began
    raise UsageError(f"meshlm {command}: {e}") from e
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
