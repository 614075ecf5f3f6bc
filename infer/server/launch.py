"""An OpenAI-compatible server with a gray (canary) release, built from its options:
`meshlm serve` (cli/serve.py) parses the flags into `ServeOptions` and runs `build`'s app.

A model path is anything `meshlm generate` loads: a meshlm workdir, an HF directory, a .gguf
file or a quantized checkpoint. The API key may also come from $MESHLM_API_KEY (so it is not
on the command line). Each version gets its own continuous-batching engine
(infer/serving.py) on its own thread. See docs/serving.md.
"""

import dataclasses
import logging
import os
import time

from infer.loading import load_any
from infer.sampling import SamplingParams
from infer.server.app import build_app
from infer.server.generation import Server
from infer.server.metrics import ServerMetrics
from infer.server.release import Release, ReleaseConfig
from infer.server.worker import EngineWorker, Versions
from infer.serving import PagedEngine

log = logging.getLogger("meshlm.serve")

WARMUPS = ("none", "basic", "full")
REFUSAL_CLASSIFIERS = ("string", "learned", "none")


@dataclasses.dataclass
class ServeOptions:
  """Everything `build` needs; the defaults are `meshlm serve`'s flags' defaults."""
  model: str
  canary: str | None = None
  canary_weight: float = 0.1
  served_model_name: str | None = None
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None
  max_model_len: int = 2048
  max_num_seqs: int = 16
  num_kv_blocks: int | None = None
  block_size: int = 16
  kv_dtype: str | None = None
  max_tokens: int = 4096
  max_concurrent: int = 256
  max_body_bytes: int = 1 << 20
  rollback_window: float = 60.0
  rollback_min_samples: int = 20
  max_error_rate_delta: float = 0.05
  max_refusal_rate_delta: float = 0.2
  max_latency_ratio: float = 3.0
  refusal_sample_rate: float = 1.0
  refusal_classifier: str = "string"
  judge: str | None = None
  judge_sample_rate: float = 0.1
  max_judge_delta: float = 0.5
  warmup: str = "basic"
  log_level: str = "info"


def load_worker(path: str, role: str, opts: ServeOptions) -> EngineWorker:
  """The model at `path` behind a started engine thread, compiled as `opts.warmup` asks."""
  log.info("%s: loading %s ...", role, path)
  start = time.perf_counter()
  model, tokenizer = load_any(path)
  engine = PagedEngine(model, tokenizer, min(opts.max_model_len, model.cfg.max_seq_len),
                       opts.max_num_seqs, block_size=opts.block_size,
                       num_blocks=opts.num_kv_blocks, kv_dtype=opts.kv_dtype)
  loaded = time.perf_counter()
  log.info("%s: loaded in %.1f s; compiling (warmup=%s) ...", role, loaded - start, opts.warmup)
  if opts.warmup == "full":
    log.info("%s: compiled %d step shapes", role, engine.precompile())
  if opts.warmup != "none":  # compile prefill and decode now, not on the first client's time
    engine.generate([[tokenizer.eos_id or 0] * 3], SamplingParams(max_tokens=2))
  log.info("%s: compiled in %.1f s", role, time.perf_counter() - loaded)
  log.info("%s: %s (%d KV blocks of %d tokens, %d MiB)", role, path, engine.blocks.num_blocks,
           opts.block_size, engine.cache_bytes >> 20)
  return EngineWorker(engine, role, path=path).start()


def validate(opts: ServeOptions) -> ReleaseConfig:
  """The release monitor's config from `opts`; ValueError naming the first bad option (a
  flag), before anything loads."""
  if not 0 < opts.port < 65536:  # 0 would pick a port at random, and never say which
    raise ValueError(f"--port={opts.port} is not a port: use 1-65535")
  config = ReleaseConfig(
      canary_weight=opts.canary_weight, window_s=opts.rollback_window,
      min_samples=opts.rollback_min_samples, max_error_rate_delta=opts.max_error_rate_delta,
      max_refusal_rate_delta=opts.max_refusal_rate_delta,
      max_latency_ratio=opts.max_latency_ratio, refusal_sample_rate=opts.refusal_sample_rate,
      judge_sample_rate=opts.judge_sample_rate, max_judge_delta=opts.max_judge_delta)
  config.validate()
  for name in ("max_model_len", "max_num_seqs", "max_tokens", "max_concurrent",
               "max_body_bytes"):
    if getattr(opts, name) < 1:
      raise ValueError(f"--{name}={getattr(opts, name)} must be >= 1")
  if opts.warmup not in WARMUPS:
    raise ValueError(f"--warmup={opts.warmup}: use one of {', '.join(WARMUPS)}")
  if opts.refusal_classifier not in REFUSAL_CLASSIFIERS:
    raise ValueError(f"--refusal_classifier={opts.refusal_classifier}: use one of "
                     f"{', '.join(REFUSAL_CLASSIFIERS)}")
  for path in filter(None, (opts.model, opts.canary, opts.judge)):
    if not os.path.exists(path):
      raise ValueError(f"model path {path} does not exist")
  return config


def build(opts: ServeOptions, make_refusal=None, make_judge=None):
  """(app, server): options checked (`validate`), models loaded, engines warm and running.

  The release monitor's checks come from the caller (they live above infer/):
  `make_refusal(opts.refusal_classifier)` -> text -> refused?, and `make_judge(opts.judge)`
  -> (prompt, text) -> reward; each may return None, and is called once the models load.
  """
  config = validate(opts)
  stable = load_worker(opts.model, "stable", opts)
  canary = load_worker(opts.canary, "canary", opts) if opts.canary else None
  name = opts.served_model_name or os.path.splitext(os.path.basename(
      os.path.normpath(opts.model)))[0]
  refusal = make_refusal(opts.refusal_classifier) if make_refusal else None
  judge = make_judge(opts.judge) if make_judge else None
  server = Server(Versions(stable, canary), Release(config, canary is not None),
                  ServerMetrics(), model_name=name,
                  api_key=opts.api_key or os.environ.get("MESHLM_API_KEY") or None,
                  max_body_bytes=opts.max_body_bytes, max_concurrent=opts.max_concurrent,
                  max_tokens_limit=opts.max_tokens, refusal=refusal, judge=judge)
  return build_app(server), server
