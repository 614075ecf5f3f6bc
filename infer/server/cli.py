"""`meshlm serve`: an OpenAI-compatible server with a gray (canary) release.

  meshlm serve --model PATH [--canary PATH --canary-weight 0.1] [--port 8000] [--api-key KEY]

PATH is anything `meshlm generate` loads: a meshlm workdir, an HF directory, a .gguf
file or a quantized checkpoint. The API key may also come from $MESHLM_API_KEY (so
it is not on the command line). Each version gets its own continuous-batching
engine (infer/serving.py) on its own thread. See docs/serving.md.
"""

import argparse
import logging
import os
import sys

log = logging.getLogger("meshlm.serve")


def _flag(parser, name, **kw):
  """--some-flag, also spelled --some_flag as meshlm's other commands spell theirs."""
  parser.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kw)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="meshlm serve", description=__doc__.split("\n")[0])
  _flag(p, "model", required=True, help="the stable model")
  _flag(p, "canary", default=None, help="a canary model, sharing the served name")
  _flag(p, "canary-weight", type=float, default=0.1, help="share of traffic to the canary")
  _flag(p, "served-model-name", default=None, help="the model id clients ask for")
  _flag(p, "host", default="127.0.0.1")
  _flag(p, "port", type=int, default=8000)
  _flag(p, "api-key", default=None, help="require 'Authorization: Bearer KEY' ($MESHLM_API_KEY)")
  _flag(p, "max-model-len", type=int, default=2048, help="context length (<= the model's)")
  _flag(p, "max-num-seqs", type=int, default=16, help="requests in one running batch")
  _flag(p, "num-kv-blocks", type=int, default=None, help="KV pool size (default: every running "
        "request at full context)")
  _flag(p, "block-size", type=int, default=16)
  _flag(p, "kv-dtype", default=None, choices=[None, "int8"])
  _flag(p, "max-tokens", type=int, default=4096, help="the largest max_tokens accepted")
  _flag(p, "max-concurrent", type=int, default=256, help="requests in flight before 429")
  _flag(p, "max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
  _flag(p, "rollback-window", type=float, default=60.0, help="monitor window, seconds")
  _flag(p, "rollback-min-samples", type=int, default=20)
  _flag(p, "max-error-rate-delta", type=float, default=0.05)
  _flag(p, "max-refusal-rate-delta", type=float, default=0.2)
  _flag(p, "max-latency-ratio", type=float, default=3.0)
  _flag(p, "refusal-sample-rate", type=float, default=1.0)
  _flag(p, "refusal-classifier", default="string", choices=["string", "learned", "none"])
  _flag(p, "judge", default=None, help="a `meshlm rm` workdir scoring sampled responses")
  _flag(p, "judge-sample-rate", type=float, default=0.1)
  _flag(p, "max-judge-delta", type=float, default=0.5)
  _flag(p, "warmup", default="basic", choices=["none", "basic", "full"],
        help="compile before serving: basic = one short request; full = every step shape "
        "(minutes on a CPU, but no request then waits for a compilation)")
  _flag(p, "log-level", default="info", choices=["debug", "info", "warning", "error"])
  return p


def _worker(path: str, role: str, args):
  from infer.sampling import SamplingParams
  from infer.server.worker import EngineWorker
  from infer.serving import PagedEngine
  from train.cli import load_any
  model, tokenizer = load_any(path, "serve")
  engine = PagedEngine(model, tokenizer, min(args.max_model_len, model.cfg.max_seq_len),
                       args.max_num_seqs, block_size=args.block_size,
                       num_blocks=args.num_kv_blocks, kv_dtype=args.kv_dtype)
  if args.warmup == "full":
    log.info("%s: compiled %d step shapes", role, engine.precompile())
  if args.warmup != "none":  # compile prefill and decode now, not on the first client's time
    engine.generate([[tokenizer.eos_id or 0] * 3], SamplingParams(max_tokens=2))
  log.info("%s: %s (%d KV blocks of %d tokens, %d MiB)", role, path, engine.blocks.num_blocks,
           args.block_size, engine.cache_bytes >> 20)
  return EngineWorker(engine, role, path=path).start()


def _refusal(kind: str):
  if kind == "none":
    return None
  if kind == "string":
    from align.evals.refusal import string_refusal
    return string_refusal
  from align.evals.refusal import train_default
  classifier = train_default()
  return lambda text: bool(classifier.predict([text])[0])


def _judge(workdir: str | None):
  if not workdir:
    return None
  from align.curate.judge import RewardJudge
  judge = RewardJudge(workdir)
  return lambda prompt, text: float(judge.scores(prompt, [text])[0])


def build(args):
  """(app, server) from parsed flags: models loaded, engines warm and running."""
  from infer.server.app import build_app
  from infer.server.generation import Server
  from infer.server.metrics import ServerMetrics
  from infer.server.release import Release, ReleaseConfig
  from infer.server.worker import Versions
  config = ReleaseConfig(
      canary_weight=args.canary_weight, window_s=args.rollback_window,
      min_samples=args.rollback_min_samples, max_error_rate_delta=args.max_error_rate_delta,
      max_refusal_rate_delta=args.max_refusal_rate_delta,
      max_latency_ratio=args.max_latency_ratio, refusal_sample_rate=args.refusal_sample_rate,
      judge_sample_rate=args.judge_sample_rate, max_judge_delta=args.max_judge_delta)
  config.validate()
  for name in ("max_model_len", "max_num_seqs", "max_tokens", "max_concurrent",
               "max_body_bytes"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  for path in filter(None, (args.model, args.canary, args.judge)):
    if not os.path.exists(path):
      raise ValueError(f"model path {path} does not exist")
  stable = _worker(args.model, "stable", args)
  canary = _worker(args.canary, "canary", args) if args.canary else None
  name = args.served_model_name or os.path.splitext(os.path.basename(
      os.path.normpath(args.model)))[0]
  server = Server(Versions(stable, canary), Release(config, canary is not None),
                  ServerMetrics(), model_name=name,
                  api_key=args.api_key or os.environ.get("MESHLM_API_KEY") or None,
                  max_body_bytes=args.max_body_bytes, max_concurrent=args.max_concurrent,
                  max_tokens_limit=args.max_tokens, refusal=_refusal(args.refusal_classifier),
                  judge=_judge(args.judge))
  return build_app(server), server


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    app, server = build(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"meshlm serve: error: {e}", file=sys.stderr)
    return 2
  import uvicorn
  log.info("serving %r on http://%s:%d (release: %s)", server.model_name, args.host, args.port,
           server.release.state)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
  finally:
    server.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
