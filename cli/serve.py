"""`meshlm serve`: an OpenAI-compatible server with a gray (canary) release.

  meshlm serve --model PATH [--canary PATH --canary_weight 0.1] [--port 8000] [--api_key KEY]

PATH is anything `meshlm generate` loads: a meshlm workdir, an HF directory, a .gguf
file or a quantized checkpoint. The API key may also come from $MESHLM_API_KEY (so
it is not on the command line). Each version gets its own continuous-batching
engine (infer/serving.py) on its own thread. See docs/serving.md. The options are
checked and the port bound before any model loads: exit status 2 on unusable input.
"""

import dataclasses
import logging
import socket
import sys
import time

import uvicorn
from absl import flags

from align.curate.judge import RewardJudge
from align.evals.refusal import string_refusal, train_default
from cli.parsing import UsageError, parse, require
from infer.server.launch import REFUSAL_CLASSIFIERS, WARMUPS, ServeOptions, build, log, validate

EXIT_BAD_INPUT = 2
LOG_LEVELS = ["debug", "info", "warning", "error"]


def make_flags(argv: list[str]) -> flags.FlagValues:
  """The flags; their defaults are ServeOptions' (infer/server/launch.py)."""
  del argv  # no --config here
  d = ServeOptions(model="")
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "the stable model", flag_values=fv)
  flags.DEFINE_string("canary", d.canary, "a canary model, sharing the served name",
                      flag_values=fv)
  flags.DEFINE_float("canary_weight", d.canary_weight, "share of traffic to the canary",
                     flag_values=fv)
  flags.DEFINE_string("served_model_name", d.served_model_name, "the model id clients ask for "
                      "(default: the model path's base name)", flag_values=fv)
  flags.DEFINE_string("host", d.host, "address to listen on", flag_values=fv)
  flags.DEFINE_integer("port", d.port, "port to listen on", flag_values=fv)
  flags.DEFINE_string("api_key", d.api_key, "require 'Authorization: Bearer KEY' "
                      "($MESHLM_API_KEY)", flag_values=fv)
  flags.DEFINE_integer("max_model_len", d.max_model_len, "context length (<= the model's)",
                       flag_values=fv)
  flags.DEFINE_integer("max_num_seqs", d.max_num_seqs, "requests in one running batch",
                       flag_values=fv)
  flags.DEFINE_integer("num_kv_blocks", d.num_kv_blocks, "KV pool size (default: every "
                       "running request at full context)", flag_values=fv)
  flags.DEFINE_integer("block_size", d.block_size, "tokens per KV block", flag_values=fv)
  flags.DEFINE_enum("kv_dtype", d.kv_dtype, ["int8"], "KV cache storage (default: compute "
                    "dtype)", flag_values=fv)
  flags.DEFINE_integer("max_tokens", d.max_tokens, "the largest max_tokens accepted",
                       flag_values=fv)
  flags.DEFINE_integer("max_concurrent", d.max_concurrent, "requests in flight before 429",
                       flag_values=fv)
  flags.DEFINE_integer("max_body_bytes", d.max_body_bytes, "larger bodies get 413",
                       flag_values=fv)
  flags.DEFINE_float("rollback_window", d.rollback_window, "monitor window, seconds",
                     flag_values=fv)
  flags.DEFINE_integer("rollback_min_samples", d.rollback_min_samples, "samples of a monitor "
                       "per version in the window before the rollback rule applies", flag_values=fv)
  flags.DEFINE_float("max_error_rate_delta", d.max_error_rate_delta, "roll back when the "
                     "canary's error rate exceeds the stable's by more", flag_values=fv)
  flags.DEFINE_float("max_refusal_rate_delta", d.max_refusal_rate_delta, "roll back when the "
                     "canary's refusal rate exceeds the stable's by more", flag_values=fv)
  flags.DEFINE_float("max_latency_ratio", d.max_latency_ratio, "roll back when the canary's "
                     "time per output token exceeds the stable's by this factor", flag_values=fv)
  flags.DEFINE_float("refusal_sample_rate", d.refusal_sample_rate, "share of responses "
                     "checked for refusals", flag_values=fv)
  flags.DEFINE_enum("refusal_classifier", d.refusal_classifier, list(REFUSAL_CLASSIFIERS),
                    "how a refusal is recognised", flag_values=fv)
  flags.DEFINE_string("judge", d.judge, "a `meshlm rm` workdir scoring sampled responses",
                      flag_values=fv)
  flags.DEFINE_float("judge_sample_rate", d.judge_sample_rate, "share of responses the judge "
                     "scores", flag_values=fv)
  flags.DEFINE_float("max_judge_delta", d.max_judge_delta, "roll back when the canary's mean "
                     "judge score falls below the stable's by more", flag_values=fv)
  flags.DEFINE_enum("warmup", d.warmup, list(WARMUPS), "compile before serving: basic = one "
                    "short request; full = every step shape (minutes on a CPU, but no request "
                    "then waits for a compilation)", flag_values=fv)
  flags.DEFINE_enum("log_level", d.log_level, LOG_LEVELS, "log level", flag_values=fv)
  return fv


def refusal_fn(kind: str):
  """text -> refused?, for the release monitor; None when `kind` is "none"."""
  if kind == "none":
    return None
  if kind == "string":
    return string_refusal
  classifier = train_default()
  return lambda text: bool(classifier.predict([text])[0])


def judge_fn(workdir: str | None):
  """(prompt, text) -> reward from a `meshlm rm` workdir; None without one."""
  if not workdir:
    return None
  judge = RewardJudge(workdir)
  return lambda prompt, text: float(judge.scores(prompt, [text])[0])


def bind(host: str, port: int) -> socket.socket:
  """A socket bound to (host, port), for uvicorn to listen on: taken before the models load,
  so that a port in use is found in a second, not after minutes of loading."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
  return sock


def main(argv: list[str], command: str = "serve") -> int:
  """`meshlm serve ARGS`: argv is everything after `serve`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "model")
  opts = ServeOptions(**{f.name: fv[f.name].value for f in dataclasses.fields(ServeOptions)})
  logging.basicConfig(level=opts.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
  if opts.log_level != "debug":  # Orbax's per-restore chatter is not the server's news
    logging.getLogger("absl").setLevel(logging.WARNING)
  try:
    validate(opts)
    sock = bind(opts.host, opts.port)
  except ValueError as e:
    raise UsageError(f"meshlm {command}: {e}") from None
  start = time.perf_counter()
  try:
    app, server = build(opts, make_refusal=refusal_fn, make_judge=judge_fn)
  except BaseException:
    sock.close()
    raise
  log.info("ready: serving %r on http://%s:%d (release: %s) after %.1f s", server.model_name,
           opts.host, opts.port, server.release.state, time.perf_counter() - start)
  config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                          timeout_graceful_shutdown=5)
  try:
    uvicorn.Server(config).run(sockets=[sock])
  finally:
    server.close()
    sock.close()
  return 0
