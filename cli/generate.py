"""`meshlm generate`: stream one completion of a prompt.

  meshlm generate --model PATH_OR_WORKDIR --prompt TEXT [--max_new_tokens N] [--chat]
                  [--temperature T] [--top_k K] [--top_p P] [--min_p P]
                  [--repetition_penalty R] [--seed S] [--gguf_quantized] [--kv_dtype int8]

--model takes a meshlm workdir, a quantized checkpoint (meshlm quantize), an HF directory
or a .gguf file.
"""

import contextlib
import signal
import threading

from absl import flags

from cli.parsing import UsageError, parse, require, require_paths
from infer import Engine, SamplingParams
from infer.loading import load_any


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
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
  return fv


def sampling_params(fv, command: str) -> SamplingParams:
  """The sampling flags, checked before any model loads (UsageError naming a bad one)."""
  try:
    if fv["max_new_tokens"].value < 1:
      raise ValueError(f"--max_new_tokens={fv['max_new_tokens'].value} must be >= 1")
    params = SamplingParams(max_tokens=fv["max_new_tokens"].value,
                            temperature=fv["temperature"].value, top_k=fv["top_k"].value,
                            top_p=fv["top_p"].value, min_p=fv["min_p"].value,
                            repetition_penalty=fv["repetition_penalty"].value,
                            seed=fv["seed"].value)
    params.validate()
    return params
  except ValueError as e:
    raise UsageError(f"meshlm {command}: {e}") from None


def run_generate(fv, params: SamplingParams) -> None:
  model, tokenizer = load_any(fv["model"].value, gguf_quantized=fv["gguf_quantized"].value)
  prompt = fv["prompt"].value
  if fv["chat"].value:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt, add_bos=False)
  else:
    ids = tokenizer.encode(prompt)
  max_new = params.max_tokens
  # A cache just long enough for this request (the model's context at most, so a request
  # that does not fit is refused naming that limit).
  engine = Engine(model, tokenizer, max_seq_len=min(max(len(ids) + max_new, 1),
                                                    model.cfg.max_seq_len), max_batch=1,
                  kv_dtype=fv["kv_dtype"].value)
  with interrupt_between_tokens() as interrupted:
    for token in engine.stream(ids, params):
      print(token.text, end="", flush=True)
      if interrupted:
        raise KeyboardInterrupt
  print()


@contextlib.contextmanager
def interrupt_between_tokens():
  """Ctrl-C while streaming is noted, and acted on after the current token: raised inside
  JAX's compile path, a KeyboardInterrupt can be swallowed by its bare `except:` (jax
  _src/interpreters/pxla.py), and generation then ran on to the end (seen under load)."""
  interrupted = []
  if threading.current_thread() is not threading.main_thread():  # only it may set handlers
    yield interrupted
    return
  previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
  try:
    yield interrupted
  finally:
    signal.signal(signal.SIGINT, previous)


def main(argv: list[str], command: str = "generate") -> None:
  """`meshlm generate ARGS`: argv is everything after `generate`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "model", "prompt")
  params = sampling_params(fv, command)
  require_paths(command, fv, "model")
  try:
    run_generate(fv, params)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
