"""Train step time of MoE layers against a dense MLP with the same active parameters.

    python benchmarks/moe.py --json                                  # reference CPU sizes
    python benchmarks/moe.py --d_model 1024 --layers 8 --seq_len 2048 --expert_mlp 1408 --json

Four variants of one Llama-shaped decoder (GQA, SwiGLU, RoPE, untied
embeddings), identical except for the MLP of every block, each with the same
parameters active per token:

* dense: one SwiGLU of mlp_dim = top_k * F;
* dropless: E experts of SwiGLU width F, top_k per token, every choice computed,
  grouped_matmul="auto" (the tiled grouped matmul on CPU, ragged_dot elsewhere);
* dropless_ragged_dot: the same with grouped_matmul="ragged_dot", which XLA's CPU
  backend lowers to a dense masked product over all E groups (~E/top_k x the
  expert FLOPs): kept to show that cost honestly, not as a recommendation;
* capacity: the GShard capacity path with --capacity_factor (1.25).

(The MoE variants also carry the router, d_model * E weights per layer, which
the JSON's param counts include.)

A step is the jitted train step of train/step.py (forward, backward, router
losses, global-norm clipping and AdamW), with the state donated, as in
train/loop.py. After --warmup untimed rounds (the first compiles), the
variants' timed steps are interleaved round robin, one step of each per round,
so background load on shared cores hits all of them alike; the JSON reports the
median and the minimum over the rounds. The ratios use medians.

Every variant has static shapes, so its step cost does not depend on where the
router sends tokens; `drop_rate` and `load_max_over_mean` are reported for
context only. On these Zipf tokens the router concentrates quickly (the model
first learns the unigram distribution, so most tokens look alike), which is why
the capacity path drops a large share of choices here.

Default sizes (d_model 256, 4 layers, 8 heads / 4 KV heads, vocab 4096, seq 256,
batch 8, E=8, top_k=2, F=512 so dense mlp_dim=1024 = 4 x d_model) keep the MLP
the largest share of the step's matmul FLOPs, as in a real LM (the JSON's
`dense_mlp_flops_share`), and run in about two minutes on two idle CPU cores
(about four when other processes load them).

One JSON document goes to stdout; progress text goes to stderr.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks.common import (constant_lr_step, cpu_count, log,  # noqa: E402
                               token_step_runner)

TARGET = 1.5  # the target: dropless step time <= 1.5 x dense, equal active params
VARIANTS = ("dense", "dropless", "dropless_ragged_dot", "capacity")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="compact JSON on stdout, nothing else")
  p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each variant)")
  p.add_argument("--warmup", type=int, default=1,
                 help="untimed rounds first (the first compiles every variant)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq_len", "--seq-len", type=int, default=256)
  p.add_argument("--d_model", "--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv_heads", "--kv-heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--experts", type=int, default=8, help="E routed experts per block")
  p.add_argument("--top_k", "--top-k", type=int, default=2)
  p.add_argument("--expert_mlp", "--expert-mlp", type=int, default=512,
                 help="F, each expert's SwiGLU width; dense mlp_dim = top_k * F")
  p.add_argument("--capacity_factor", "--capacity-factor", type=float, default=1.25)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma-separated subset of {','.join(VARIANTS)}")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  if not 1 <= args.top_k <= args.experts:
    p.error("need 1 <= --top_k <= --experts")
  args.variants = [v for v in args.variants.split(",") if v]
  unknown = sorted(set(args.variants) - set(VARIANTS))
  if unknown or not args.variants:
    p.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
  return args


def model_configs(args):
  """{variant: ModelConfig}, equal active parameters per token up to the router."""
  from models import ModelConfig
  base = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                     num_heads=args.heads, num_kv_heads=args.kv_heads,
                     mlp_dim=args.top_k * args.expert_mlp, rope_theta=10000.0,
                     tie_embeddings=False, max_seq_len=args.seq_len, dtype=args.dtype)
  moe = dataclasses.replace(base, mlp_dim=args.expert_mlp, num_experts=args.experts,
                            top_k=args.top_k, moe_impl="dropless", grouped_matmul="auto",
                            capacity_factor=args.capacity_factor)
  cfgs = {"dense": base, "dropless": moe,
          "dropless_ragged_dot": dataclasses.replace(moe, grouped_matmul="ragged_dot"),
          "capacity": dataclasses.replace(moe, moe_impl="capacity")}
  return {v: cfgs[v] for v in args.variants}


def make_tokens(args, n):
  """[n, B, T + 1] int32 Zipf-distributed ids, one fresh batch per step (shared by variants)."""
  rng = np.random.default_rng(args.seed)
  p = 1.0 / np.arange(1, args.vocab + 1)
  return rng.choice(args.vocab, size=(n, args.batch, args.seq_len + 1),
                    p=p / p.sum()).astype(np.int32)


def build(cfg, args, total_steps):
  """A run_step(tokens) -> metrics (synchronised) closure over a donated train state."""
  import jax

  import parallel
  from train.defaults import base_config

  o = base_config().optimizer
  hp = {k: float(o[k]) for k in ("lr", "b1", "b2", "eps", "weight_decay", "clip_norm")}
  step_fn, state, batch_sharding, mesh, layout = constant_lr_step(cfg, hp, total_steps, args.seed)
  step = token_step_runner(step_fn, state, batch_sharding, args.batch, args.seq_len)

  def run_step(toks):
    with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
      return jax.device_get(step(toks))  # waits for the step

  return run_step


def summarise(cfg, times, metrics_log, tokens_per_step):
  losses = [float(m["loss"]) for m in metrics_log]
  out = {"step_time_median_s": statistics.median(times), "step_time_min_s": min(times),
         "step_time_mean_s": statistics.fmean(times),
         "tokens_per_s": tokens_per_step / statistics.median(times),
         "num_params": cfg.num_params(), "active_params": cfg.num_params(active=True),
         "mlp_dim": cfg.mlp_dim, "num_experts": cfg.num_experts,
         "loss_first": losses[0], "loss_last": losses[-1],
         "loss_finite": bool(np.all(np.isfinite(losses)))}
  if cfg.is_moe:
    last = metrics_log[-1]
    out.update(top_k=cfg.top_k, moe_impl=cfg.moe_impl, grouped_matmul=cfg.grouped_matmul,
               drop_rate=float(np.mean([float(m["moe/drop_rate"]) for m in metrics_log])),
               load_max_over_mean=float(last["moe/load_max_over_mean"]))
    if cfg.moe_impl == "capacity":
      out["capacity_factor"] = cfg.capacity_factor
  return out


def main(argv=None):
  args = parse_args(argv)
  import flax
  import jax

  from models import moe_dispatch
  from train import flops as flops_lib

  load_start = os.getloadavg()[0]
  if load_start > 0.5 * cpu_count():
    log(f"warning: 1-minute load average {load_start:.1f}; the interleaved rounds share it, "
        "but absolute times will suffer")
  cfgs = model_configs(args)
  tokens = make_tokens(args, args.warmup + args.steps)
  tokens_per_step = args.batch * args.seq_len
  steps, times, metrics = {}, {v: [] for v in cfgs}, {v: [] for v in cfgs}
  for v, cfg in cfgs.items():
    start = time.perf_counter()
    steps[v] = build(cfg, args, args.warmup + args.steps)
    log(f"{v}: state built in {time.perf_counter() - start:.1f}s")
  for i in range(args.warmup):  # the first round compiles every variant's step
    start = time.perf_counter()
    for v in cfgs:
      steps[v](tokens[i])
    log(f"warmup round {i + 1}/{args.warmup}: {time.perf_counter() - start:.1f}s")
  for r in range(args.steps):
    for v in cfgs:
      start = time.perf_counter()
      m = steps[v](tokens[args.warmup + r])
      times[v].append(time.perf_counter() - start)
      metrics[v].append(m)
    log(f"round {r + 1}/{args.steps}: " + ", ".join(f"{v} {times[v][-1] * 1e3:.0f}ms"
                                                     for v in cfgs))
  results = {v: summarise(cfgs[v], times[v], metrics[v], tokens_per_step) for v in cfgs}

  def ratio(v):
    if v not in results or "dense" not in results:
      return None
    return results[v]["step_time_median_s"] / results["dense"]["step_time_median_s"]

  dense_cfg = cfgs.get("dense") or dataclasses.replace(
      next(iter(cfgs.values())), num_experts=0, mlp_dim=args.top_k * args.expert_mlp)
  mlp_flops = 6 * dense_cfg.num_layers * dense_cfg.mlp_params()
  dropless_ratio = ratio("dropless")
  rows = args.batch * args.seq_len * args.top_k
  result = {
      "benchmark": "moe",
      "config": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                 "kv_heads": args.kv_heads, "vocab": args.vocab, "seq_len": args.seq_len,
                 "batch": args.batch, "experts": args.experts, "top_k": args.top_k,
                 "expert_mlp": args.expert_mlp, "dense_mlp": args.top_k * args.expert_mlp,
                 "capacity_factor": args.capacity_factor, "dtype": args.dtype,
                 "tiled_tile_size": moe_dispatch.tile_size(rows, args.experts),
                 "optimizer": "adamw (train/defaults.py), constant lr",
                 "data": "zipf tokens, numpy seed %d" % args.seed},
      "steps": args.steps, "warmup": args.warmup, "tokens_per_step": tokens_per_step,
      "dense_mlp_flops_share": mlp_flops / flops_lib.train_flops_per_token(dense_cfg,
                                                                           args.seq_len),
      "env": {"jax": jax.__version__, "flax": flax.__version__,
              "python": platform.python_version(), "backend": jax.default_backend(),
              "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "cpu_count": cpu_count(), "machine": platform.machine(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "loadavg_1m": [load_start, os.getloadavg()[0]]},
      "variants": results,
      "ratio_dropless_over_dense": dropless_ratio,
      "ratio_dropless_ragged_dot_over_dense": ratio("dropless_ragged_dot"),
      "ratio_capacity_over_dense": ratio("capacity"),
      "target": f"dropless <= {TARGET}x dense (median step time, equal active params)",
      "target_ratio": TARGET,
      "target_met": None if dropless_ratio is None else dropless_ratio <= TARGET,
  }
  if dropless_ratio is not None:
    log(f"dropless/dense = {dropless_ratio:.2f}x (target <= {TARGET}x: "
        f"{'met' if dropless_ratio <= TARGET else 'not met'})")
  print(json.dumps(result) if args.json else json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
