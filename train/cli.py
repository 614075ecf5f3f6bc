"""The `meshlm` command line.

  meshlm train --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE ...]
  meshlm sft|rm|dpo|distill --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE ...]
                  (alignment on the same loop: align/tasks.py)
  meshlm ppo|grpo (as above: on-policy RL, align/ppo.py, align/grpo.py)
  meshlm generate --model PATH_OR_WORKDIR --prompt TEXT [--max_new_tokens N] [--chat]
                  [--temperature T] [--top_k K] [--top_p P] [--min_p P]
                  [--repetition_penalty R] [--seed S] [--gguf_quantized] [--kv_dtype int8]
  meshlm plan --config experiments/NAME.py --devices N [--mesh data=..,fsdp=..] [--budget_gb X] [--compile]
  meshlm quantize --model PATH --format int4-g128 [--method gptq|rtn] [--calib DATA] --out DIR
                  (infer/quant/cli.py)
  meshlm embed --model DIR --input FILE(.txt|.jsonl) [--output FILE.npy|.jsonl] [--batch_size N]
                  (infer/embed.py)
  meshlm pairs --config experiments/NAME.py --workdir DIR   (teacher-judged preference pairs:
                  align/curate/pairs.py)
  meshlm review --db PATH [--host H] [--port N] [--lease_s S] [--export ROOT | --report]
                  (human review page: align/curate/review_server.py)
  meshlm data ls ROOT | show PATH | diff A B | register PATH  (data assets: align/data_cli.py)
  meshlm selfinstruct --config experiments/selfinstruct.py --out DIR  (align/curate/selfinstruct.py)
  meshlm eval --model PATH --suite hhh|helpful|harmless|honest|redteam --out DIR [--limit N]
                  (align/evals/cli.py)
  meshlm gate --baseline REPORT --candidate REPORT [--max-drop helpful=0.02,...]
                  (align/evals/gate.py; exits 1 on a regression)
  meshlm serve --model PATH [--canary PATH --canary-weight 0.1] [--port 8000] [--api-key KEY]
      (OpenAI-compatible server with a gray release: infer/server/, docs/serving.md)
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

TRAIN_COMMANDS = ("train", "sft", "rm", "dpo", "distill", "ppo", "grpo")
# Commands whose module parses its own flags: name -> (module, function).
DELEGATED = {"plan": ("parallel.plan_cli", "main"), "quantize": ("infer.quant.cli", "main"),
             "embed": ("infer.embed", "main"), "pairs": ("align.curate.pairs", "main"),
             "review": ("align.curate.review_server", "main"), "data": ("align.data_cli", "main"),
             "selfinstruct": ("align.curate.selfinstruct", "main"), "eval": ("align.evals.cli", "main"),
             "gate": ("align.evals.gate", "main"), "serve": ("infer.server.cli", "main")}
COMMANDS = TRAIN_COMMANDS + ("generate",) + tuple(DELEGATED)


def _parse(argv: list[str]):
  """absl parsing of everything after the subcommand; returns the FlagValues."""
  fv = flags.FlagValues()
  if argv[0] in TRAIN_COMMANDS:
    # sys_argv: override flags (--config.a.b=v) are discovered from these args.
    config_flags.DEFINE_config_file("config", None, "experiment config file", flag_values=fv,
                                    lock_config=True, sys_argv=["meshlm"] + argv[1:])
    flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and logs",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process)",
                        flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "number of processes (multi-process)",
                         flag_values=fv)
    flags.DEFINE_integer("process_id", None, "this process's id (multi-process)", flag_values=fv)
  else:
    flags.DEFINE_string("model", None, "HF directory, .gguf file, meshlm workdir or quantized "
                        "checkpoint (meshlm quantize)", flag_values=fv)
    flags.DEFINE_string("prompt", None, "prompt text", flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "0 = greedy", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "sample from the k most likely tokens (0 = all)",
                         flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "sample from the smallest set of tokens with this mass",
                       flag_values=fv)
    flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p times the top probability",
                       flag_values=fv)
    flags.DEFINE_float("repetition_penalty", 1.0, "CTRL penalty on seen tokens (1 = off)",
                       flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
    flags.DEFINE_bool("gguf_quantized", False, "run a .gguf's Q4_0/Q4_1/Q8_0 weights as "
                      "stored (packed INT4/INT8) instead of dequantizing them", flag_values=fv)
    flags.DEFINE_enum("kv_dtype", None, ["int8"], "KV cache storage (default: compute dtype)",
                      flag_values=fv)
    flags.DEFINE_bool("chat", False, "wrap the prompt in the model's chat template",
                      flag_values=fv)
  try:
    fv(["meshlm"] + argv[1:])
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    raise SystemExit(f"meshlm {argv[0]}: {str(e).strip(chr(39))}")
  return fv


def _require(fv, *names):
  missing = [n for n in names if fv[n].value is None]
  if missing:
    raise SystemExit(f"meshlm: missing required flag(s): {', '.join('--' + n for n in missing)}")


def make_task(command: str, config, workdir: str):
  """None (pretraining: the loop's LMTask) or the alignment task of `command`."""
  if command == "train":
    return None
  from align.distill import DistillTask
  from align.dpo import DPOTask
  from align.grpo import GRPOTask
  from align.ppo import PPOTask
  from align.reward import RewardTask
  from align.sft import SFTTask
  return {"sft": SFTTask, "rm": RewardTask, "dpo": DPOTask, "distill": DistillTask,
          "ppo": PPOTask, "grpo": GRPOTask}[command](config, workdir)


def run_train(fv, command: str = "train") -> None:
  _require(fv, "workdir")
  config_file = fv["config"].config_filename if fv["config"].present else None
  if config_file is None:
    raise SystemExit(f"meshlm {command}: missing required flag --config")
  # "path.py:arg" passes arg to get_config (ml_collections keeps it in the filename).
  if not os.path.isfile(config_file.split(":")[0]):
    raise SystemExit(f"meshlm {command}: config file {config_file} does not exist")
  config = fv["config"].value
  from parallel.distributed import initialize
  initialize(fv["coordinator_address"].value, fv["num_processes"].value, fv["process_id"].value)
  from infer import generate
  from train.loop import train
  from train.workdir import load_trained
  from train import exit_codes
  from train.fault import Preempted
  from train.watchdog import PeerMonitor
  from align.evals.promote import make_gate  # the eval_gate hook train() runs (train/gate.py)
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
  print({k: round(v, 4) for k, v in last.items()})
  generates = config.model.arch in ("decoder", "prefix_lm") and command == "train"
  if config.sample.prompt and config.sample.max_new_tokens > 0 and generates:
    import jax
    if jax.process_index() == 0:
      model, tokenizer, _ = load_trained(fv["workdir"].value)
      ids = generate(model, tokenizer.encode(config.sample.prompt, add_bos=True),
                     config.sample.max_new_tokens, temperature=config.sample.temperature,
                     top_k=config.sample.top_k, seed=config.seed, eos_id=tokenizer.eos_id)
      print("--- sample ---\n" + config.sample.prompt + tokenizer.decode(ids))


def load_any(path: str, command: str = "generate", gguf_quantized: bool = False):
  """(model, tokenizer) from a meshlm workdir, a quantized checkpoint (`meshlm quantize`),
  an HF directory or a .gguf file (kept quantized as stored with `gguf_quantized`)."""
  from train.workdir import is_workdir, load_trained
  if not os.path.exists(path):
    raise SystemExit(f"meshlm {command}: model path {path} does not exist")
  from infer.quant.checkpoint import is_quantized_dir, load_quantized
  if is_quantized_dir(path):
    return load_quantized(path)
  if is_workdir(path):
    model, tokenizer, _ = load_trained(path)
    return model, tokenizer
  from models import load_pretrained
  return load_pretrained(path, quantized=gguf_quantized)


def run_generate(fv) -> None:
  _require(fv, "model", "prompt")
  from infer import Engine, SamplingParams
  model, tokenizer = load_any(fv["model"].value, gguf_quantized=fv["gguf_quantized"].value)
  prompt = fv["prompt"].value
  if fv["chat"].value:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt, add_bos=False)
  else:
    ids = tokenizer.encode(prompt)
  max_new = fv["max_new_tokens"].value
  params = SamplingParams(max_tokens=max_new, temperature=fv["temperature"].value,
                          top_k=fv["top_k"].value, top_p=fv["top_p"].value,
                          min_p=fv["min_p"].value,
                          repetition_penalty=fv["repetition_penalty"].value, seed=fv["seed"].value)
  # A cache just long enough for this request (the model's context at most, so a request
  # that does not fit is refused naming that limit).
  engine = Engine(model, tokenizer, max_seq_len=min(max(len(ids) + max_new, 1),
                                                    model.cfg.max_seq_len), max_batch=1,
                  kv_dtype=fv["kv_dtype"].value)
  for token in engine.stream(ids, params):
    print(token.text, end="", flush=True)
  print()


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  from parallel.xla_flags import apply_overlap_flags
  apply_overlap_flags()  # before any JAX backend starts
  if not argv or argv[0] not in COMMANDS:
    raise SystemExit(f"usage: meshlm {{{'|'.join(COMMANDS)}}} [flags]   (meshlm CMD --help)")
  if argv[0] in DELEGATED:
    import importlib
    module, function = DELEGATED[argv[0]]
    return getattr(importlib.import_module(module), function)(argv[1:])
  fv = _parse(argv)
  try:
    if argv[0] in TRAIN_COMMANDS:
      run_train(fv, argv[0])
    else:
      run_generate(fv)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {argv[0]}: error: {e}") from e


if __name__ == "__main__":
  sys.exit(main())
