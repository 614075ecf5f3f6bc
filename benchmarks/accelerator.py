"""One accelerator benchmark: training MFU, attention kernels, MoE, decode, quantization, energy.

    python benchmarks/accelerator.py --json            # no set-up, no arguments needed
    python benchmarks/accelerator.py --json --toy --rows train,attention

Rows (random-init weights, fixed seeds, nothing downloaded):
  train        tokens/s and MFU of a ~350M and a ~1B decoder (bf16 compute, float32
               params, seq 2048): the jitted, donated AdamW step of train/step.py
               (benchmarks/common.py), warm-up steps first, then timed steps;
               MFU = tokens/s x train/flops.py's FLOPs per token / (peak x devices).
  energy       while the timed training steps run, board power is sampled through NVML
               (pynvml) every 50 ms: average W, tokens per joule; $ per million tokens
               = price_per_device_hour x devices / 3600 / tokens/s x 1e6 (+ energy at
               --usd_per_kwh when given). Without NVML, power is null with the reason.
  attention    causal forward+backward at 2k/8k/32k, cuDNN against the pure-JAX
               blockwise kernel (models/attention.py): time and memory per length.
  moe          dropless MoE (8 experts, top-2, expert width = dense width / 2) against
               dense at equal active parameters: train step time (benchmarks/moe.py).
  decode       output tokens/s of PagedEngine (paged KV cache) at batch 1/16/64.
  speculative  SpeculativeDecoder with a model draft against the target alone.
  quant        batch-1 decode tokens/s with INT8 and INT4 weights against bf16.

Peak FLOP/s (PEAK_TFLOPS_BF16, dense bf16 tensor-core TFLOP/s per chip, from the
vendors' public spec sheets; sparsity excluded), matched on jax's device_kind:
  NVIDIA H100 SXM 989 | H100 PCIe 756 | H100 NVL 835 | H200 989 | A100 312 | L4 121
  TPU v4 275 | v5e ("TPU v5 lite") 197 | v5p 459 | v6e ("TPU v6 lite") 918
A device not in the table (and every CPU) gets a measured matmul peak instead
(train/flops.py: the best of a few large square matmuls), and the JSON says so.

On CPU (or with --toy) every row runs at toy sizes (d_model <= 128, 2 layers, seq 64,
decode batch 1/2/4), so CI runs the whole script in about a minute; training there
computes in float32, against the measured float32 matmul peak. cuDNN rows are
{"skipped": true, "reason": ...} off GPU. The default sizes fit in about 8 minutes
on one H100/H200 (compilation included); --time_budget_s skips (and says so) the
rows that would start after the budget is spent.

One JSON document goes to stdout; progress goes to stderr.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import (constant_lr_step, cpu_count, log,  # noqa: E402
                               token_step_runner)

ROWS = ("train", "attention", "moe", "decode", "speculative", "quant")
PRICE_PER_DEVICE_HOUR = 2.50  # an example on-demand price in $; pass your own

# (substring of jax's device_kind, dense bf16 TFLOP/s per chip): public spec sheets.
# Order matters: the first match wins, so the specific names come before "H100".
PEAK_TFLOPS_BF16 = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
    ("A100", 312.0), ("L4", 121.0),
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0),
    ("TPU v5", 459.0), ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
)

_350M = dict(vocab=32000, d_model=1024, layers=24, heads=16, kv_heads=8, mlp=2816)
_1B = dict(vocab=32000, d_model=2048, layers=18, heads=16, kv_heads=8, mlp=5632)
_TOY_S = dict(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, mlp=128)
_TOY_L = dict(vocab=512, d_model=128, layers=2, heads=4, kv_heads=2, mlp=256)
SIZES = {
    "accelerator": {
        "train": {"seq": 2048, "warmup": 2, "steps": 8, "dtype": "bfloat16",
                  "models": {"350m": dict(_350M, batch=8), "1b": dict(_1B, batch=4)}},
        "attention": dict(lengths=(2048, 8192, 32768), tokens=32768, heads=16, kv_heads=8,
                          head_dim=128, block=512, repeats=5, dtype="bfloat16"),
        "moe": dict(batch=8, seq_len=2048, d_model=1024, layers=8, heads=16, kv_heads=8,
                    vocab=32000, experts=8, top_k=2, expert_mlp=1408, dtype="bfloat16",
                    warmup=1, steps=5),
        "decode": dict(batches=(1, 16, 64), prompt=128, new=128, dtype="bfloat16"),
        "speculative": dict(prompts=3, prompt=128, new=128, gamma=4, draft_layers=4,
                            dtype="bfloat16"),
        "quant": dict(prompt=128, new=128, repeats=5),
        "decode_model": _350M,
    },
    "toy": {
        "train": {"seq": 64, "warmup": 1, "steps": 3, "dtype": "float32",
                  "models": {"350m": dict(_TOY_S, batch=4), "1b": dict(_TOY_L, batch=2)}},
        "attention": dict(lengths=(64, 128, 256), tokens=256, heads=4, kv_heads=2,
                          head_dim=32, block=32, repeats=3, dtype="float32"),
        "moe": dict(batch=4, seq_len=64, d_model=64, layers=2, heads=4, kv_heads=2, vocab=256,
                    experts=4, top_k=2, expert_mlp=64, dtype="float32", warmup=1, steps=3),
        # float32 where the row allows it: XLA's CPU backend emulates bf16 (slower compiles)
        "decode": dict(batches=(1, 2, 4), prompt=16, new=16, dtype="float32"),
        "speculative": dict(prompts=2, prompt=16, new=16, gamma=3, draft_layers=1,
                            dtype="float32"),
        "quant": dict(prompt=16, new=16, repeats=1),
        "decode_model": _TOY_S,
    },
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="compact JSON on stdout (else indented)")
  p.add_argument("--toy", action="store_true", help="toy sizes on any device (CPU always)")
  p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {ROWS}")
  p.add_argument("--price_per_device_hour", type=float, default=PRICE_PER_DEVICE_HOUR,
                 help="$ per device-hour for cost per million tokens (default: an example)")
  p.add_argument("--usd_per_kwh", type=float, default=0.0,
                 help="energy price; > 0 adds measured energy to the cost (needs NVML)")
  p.add_argument("--time_budget_s", type=float, default=0.0,
                 help="> 0: rows that would start after this many seconds are skipped")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  for name in ("price_per_device_hour", "usd_per_kwh", "time_budget_s"):
    value = getattr(args, name)
    if not (math.isfinite(value) and value >= 0):
      p.error(f"--{name} must be a finite number >= 0, got {value}")
  args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  bad = sorted(set(args.rows) - set(ROWS))
  if bad or not args.rows:
    p.error(f"--rows: unknown {bad}; choose from {','.join(ROWS)}")
  return args


def peak_flops(platform_name: str, kind: str, dtype: str) -> tuple[float, str]:
  """(peak FLOP/s per device, source): the table, else a measured matmul of `dtype`."""
  import jax.numpy as jnp

  from train.flops import measure_matmul_peak
  if platform_name != "cpu":
    for name, tflops in PEAK_TFLOPS_BF16:
      if name.lower() in kind.lower():
        return tflops * 1e12, f"table: {name} dense bf16 (public spec sheets)"
  return measure_matmul_peak(jnp.dtype(dtype)), f"measured {dtype} matmul ({kind})"


class PowerSampler:
  """Average board power over a `with` block, NVML summed over the local devices."""

  def __init__(self, platform_name: str, devices: int, interval_s: float = 0.05):
    self.samples, self.reason, self._handles = [], None, []
    self.interval_s, self._stop = interval_s, threading.Event()
    if platform_name != "gpu":
      self.reason = f"NVML measures NVIDIA GPUs; this platform is {platform_name!r}"
      return
    try:
      import pynvml
      pynvml.nvmlInit()
      count = min(pynvml.nvmlDeviceGetCount(), devices)
      self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
      self._nvml = pynvml
    except Exception as e:  # noqa: BLE001 -- no NVML is a reason to report, not a failure
      self.reason = (f"NVML unavailable ({type(e).__name__}: {e}); "
                     "pip install nvidia-ml-py for power")

  def _loop(self):
    while not self._stop.is_set():
      try:
        self.samples.append(sum(self._nvml.nvmlDeviceGetPowerUsage(h) for h in self._handles)
                            / 1e3)  # mW -> W
      except Exception as e:  # noqa: BLE001
        self.reason = f"NVML power read failed: {type(e).__name__}: {e}"
        return
      self._stop.wait(self.interval_s)

  def __enter__(self):
    if self._handles:
      self._thread = threading.Thread(target=self._loop, daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    if self._handles:
      self._stop.set()
      self._thread.join()

  def average_w(self):
    return sum(self.samples) / len(self.samples) if self.samples and not self.reason else None


def train_model(name, spec, sz, peak, platform_name, seed):
  """One training row: tokens/s, MFU and the power drawn during the timed steps."""
  import jax

  import parallel
  from benchmarks import train_throughput as tt
  from benchmarks.turns import time_steps
  from benchmarks.accelerator_rows import model_config
  from train.flops import train_flops_per_token
  args = tt.parse_args([f"--steps={sz['steps']}", f"--warmup={sz['warmup']}",
                        f"--batch={spec['batch']}", f"--seq={sz['seq']}", f"--seed={seed}",
                        f"--vocab={spec['vocab']}"])
  tokens = tt.make_tokens(args)  # Zipf ids, one fresh batch per step
  cfg = model_config(spec, sz["seq"], sz["dtype"])
  step_fn, state, batch_sharding, mesh, layout = constant_lr_step(
      cfg, tt.optimizer_hparams(), len(tokens), seed)
  step = token_step_runner(step_fn, state, batch_sharding, spec["batch"], sz["seq"])

  def run_step(toks):
    return float(jax.block_until_ready(step(toks)["loss"]))

  sampler = PowerSampler(platform_name, jax.local_device_count())
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
    start = time.perf_counter()
    time_steps(run_step, tokens[:sz["warmup"]], sz["warmup"])  # compiles
    compile_s = time.perf_counter() - start
    with sampler:
      times, cpu, losses = time_steps(run_step, tokens[sz["warmup"]:], 0)
  out = tt.summarise(times, cpu, losses, spec["batch"] * sz["seq"])
  fpt = train_flops_per_token(cfg, sz["seq"])
  out.update(mfu=out["tokens_per_s"] * fpt / (peak * jax.device_count()),
             train_flops_per_token=fpt, num_params=cfg.num_params(), warmup_s=compile_s,
             config=dict(spec, seq=sz["seq"], dtype=sz["dtype"], param_dtype="float32"))
  log(f"train {name}: {out['num_params'] / 1e6:.1f}M params, {out['tokens_per_s']:.0f} "
      f"tokens/s, MFU {out['mfu']:.3f}")
  return out, sampler


def energy_row(tokens_per_s, sampler, devices, price, usd_per_kwh):
  avg_w = sampler.average_w()
  device_usd = price * devices / 3600 / tokens_per_s * 1e6
  out = {"tokens_per_s": tokens_per_s, "avg_power_w": avg_w,
         "power_reason": None if avg_w is not None else (sampler.reason or "no power samples"),
         "power_samples": len(sampler.samples), "device_usd_per_million_tokens": device_usd,
         "tokens_per_joule": None, "kwh_per_million_tokens": None,
         "energy_usd_per_million_tokens": None, "usd_per_million_tokens": device_usd}
  if avg_w is not None:
    kwh = avg_w * 1e6 / tokens_per_s / 3.6e6
    out.update(tokens_per_joule=tokens_per_s / avg_w, kwh_per_million_tokens=kwh)
    if usd_per_kwh > 0:
      out.update(energy_usd_per_million_tokens=kwh * usd_per_kwh,
                 usd_per_million_tokens=device_usd + kwh * usd_per_kwh)
  return out


def run_rows(args, sizes, platform_name, kind, t0):
  """{row: result}; a row that raises reports its error and the others still run."""
  import jax

  from benchmarks import accelerator_rows as rows_lib
  results, peak_info = {}, {}

  def over_budget(name):
    if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
      results[name] = {"skipped": True, "reason": f"--time_budget_s={args.time_budget_s} spent"}
      return True
    return False

  def guarded(name, fn):
    if name not in args.rows:
      results[name] = {"skipped": True, "reason": "not selected (--rows)"}
      return
    if over_budget(name):
      return
    start = time.perf_counter()
    try:
      results[name] = fn()
      results[name]["wall_s"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 -- one failing row must not hide the others
      log(traceback.format_exc())
      results[name] = {"error": f"{type(e).__name__}: {e}", "wall_s": time.perf_counter() - start}

  def train():
    sz = sizes["train"]
    peak, source = peak_flops(platform_name, kind, sz["dtype"])
    peak_info.update(peak_flops_per_device=peak, peak_source=source)
    out, energy = {"peak_flops_per_device": peak, "peak_source": source}, {}
    for name, spec in sz["models"].items():
      out[name], sampler = train_model(name, spec, sz, peak, platform_name, args.seed)
      energy[name] = energy_row(out[name]["tokens_per_s"], sampler, jax.device_count(),
                                args.price_per_device_hour, args.usd_per_kwh)
    results["energy"] = dict(energy, price_per_device_hour=args.price_per_device_hour,
                             usd_per_kwh=args.usd_per_kwh, devices=jax.device_count(),
                             measured_during="the timed steps of each training row")
    return out

  guarded("train", train)
  if "energy" not in results:
    results["energy"] = {"skipped": True, "reason": "measured during the train row, which "
                         "did not run"}
  model = sizes["decode_model"]
  guarded("attention", lambda: rows_lib.row_attention(sizes["attention"]))
  guarded("moe", lambda: rows_lib.row_moe(sizes["moe"]))
  guarded("decode", lambda: rows_lib.row_decode(sizes["decode"], model))
  guarded("speculative", lambda: rows_lib.row_speculative(sizes["speculative"], model))
  guarded("quant", lambda: rows_lib.row_quant(sizes["quant"], model))
  return results


def main(argv=None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  import flax
  import jax
  dev = jax.devices()[0]
  platform_name, kind = dev.platform, dev.device_kind
  toy = args.toy or platform_name == "cpu"
  log(f"accelerator benchmark on {jax.device_count()} x {kind} ({platform_name}), "
      f"{'toy' if toy else 'accelerator'} sizes, rows {args.rows}")
  with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON document only
    results = run_rows(args, SIZES["toy" if toy else "accelerator"], platform_name, kind, t0)
  result = {
      "benchmark": "accelerator", "toy": toy, "rows_selected": args.rows,
      "env": {"platform": platform_name, "device_kind": kind, "devices": jax.device_count(),
              "jax": jax.__version__, "flax": flax.__version__,
              "python": platform.python_version(), "cpu_count": cpu_count(),
              "xla_flags": os.environ.get("XLA_FLAGS", "")},
      **results, "wall_s": time.perf_counter() - t0}
  print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
  return 1 if any(isinstance(r, dict) and "error" in r for r in results.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
