"""The non-training rows of benchmarks/accelerator.py: attention, MoE, decode, speculative, quant.

Each `row_*(sizes)` takes its block of accelerator.SIZES and returns a JSON-ready
dict of measured numbers; a kernel the hardware lacks is {"skipped": True, "reason"}.
Models are random-init (fixed seeds), so speed is real but text is not.
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import log


class IdTokenizer:
  """What the engines need of a tokenizer for token-id prompts: decode, eos/bos ids."""

  eos_id = bos_id = None

  def encode(self, text, add_bos=None):
    return [ord(c) % 256 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(0x100 + int(i)) for i in ids)  # printable, one char per id


def model_config(spec: dict, max_seq_len: int, dtype: str, param_dtype: str = "float32"):
  """A Llama-shaped decoder from a SIZES entry (vocab, d_model, layers, heads, kv_heads, mlp)."""
  from models import ModelConfig
  return ModelConfig(vocab_size=spec["vocab"], d_model=spec["d_model"],
                     num_layers=spec["layers"], num_heads=spec["heads"],
                     num_kv_heads=spec["kv_heads"], mlp_dim=spec["mlp"], rope_theta=10000.0,
                     tie_embeddings=False, max_seq_len=max_seq_len, dtype=dtype,
                     param_dtype=param_dtype)


def build_model(cfg, seed: int = 0):
  from flax import nnx
  from models import Transformer
  return Transformer(cfg, nnx.Rngs(seed))


def device_peak_bytes():
  """The device allocator's high-water mark so far (process-wide), or None where absent."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def compiled_bytes(compiled) -> dict:
  """Arguments + outputs + temporaries of one executable (XLA's memory_analysis)."""
  ma = compiled.memory_analysis()
  if ma is None:
    return {"memory_bytes": None, "temp_bytes": None}
  from train.plan.aot import peak_bytes
  return {"memory_bytes": int(peak_bytes(ma)), "temp_bytes": int(ma.temp_size_in_bytes)}


def _median_time(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # warm-up (the compile happened in lower().compile())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


# ------------------------------------------------------------------------------- attention

def row_attention(sz: dict) -> dict:
  """Causal self-attention forward + backward (grads of q, k, v), cuDNN against blockwise.

  Each length T runs B = tokens // T sequences, so every call sees the same tokens.
  cuDNN is models/attention.py's `_cudnn` called directly: `attention(impl="cudnn")` would
  fall back to blockwise silently where cuDNN refuses, and this row must not mislabel.
  """
  from models import attention as attn
  n, k, h = sz["heads"], sz["kv_heads"], sz["head_dim"]
  dtype = jnp.dtype(sz["dtype"])
  spec = attn._Spec(causal=True, window=0, match_segments=False, scale=h ** -0.5,
                    block_q=sz["block"], block_kv=sz["block"])
  kernels = {
      "cudnn": lambda q, kk, v: attn._cudnn(q, kk, v, None, spec),
      "blockwise": lambda q, kk, v: attn.attention(q, kk, v, impl="blockwise",
                                                   block_q=sz["block"], block_kv=sz["block"]),
  }
  out = {"config": dict(sz, causal=True, grads="dq, dk, dv (forward + backward)")}
  for impl, kernel in kernels.items():
    rows = {}
    for t in sz["lengths"]:
      b = max(1, sz["tokens"] // t)
      keys = jax.random.split(jax.random.key(t), 4)
      q = jax.random.normal(keys[0], (b, t, n, h), dtype)
      kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
      v = jax.random.normal(keys[2], (b, t, k, h), dtype)
      dout = jax.random.normal(keys[3], (b, t, n, h), dtype)
      if impl == "cudnn":
        reason = attn._fast_path_refusal("cudnn", q, kk, v, None, None, None, None, None)
        if reason:
          rows[str(t)] = {"skipped": True, "reason": f"cuDNN unavailable: {reason}"}
          continue

      def loss(q, kk, v, dout=dout, kernel=kernel):
        return jnp.sum(kernel(q, kk, v).astype(jnp.float32) * dout.astype(jnp.float32))

      fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      try:
        compiled = fn.lower(q, kk, v).compile()
        seconds = _median_time(compiled, (q, kk, v), sz["repeats"])
      except Exception as e:  # noqa: BLE001 -- cuDNN's own refusals surface at compile/run
        if impl != "cudnn":
          raise
        rows[str(t)] = {"skipped": True, "reason": f"cuDNN failed: {type(e).__name__}: {e}"}
        continue
      flops = 3 * 2 * b * t * t * n * h  # 3x the causal forward (half of 4·B·T²·N·H)
      rows[str(t)] = dict(batch=b, time_s=seconds, tflops_per_s=flops / seconds / 1e12,
                          **compiled_bytes(compiled), device_peak_bytes=device_peak_bytes())
      log(f"attention {impl} T={t}: {seconds * 1e3:.2f} ms, {rows[str(t)]['memory_bytes']} B")
    out[impl] = rows
  out["speedup_cudnn_over_blockwise"] = {
      t: out["blockwise"][t]["time_s"] / out["cudnn"][t]["time_s"]
      for t in out["blockwise"] if "time_s" in out["cudnn"].get(t, {})}
  out["memory_note"] = ("memory_bytes: the compiled step's arguments + outputs + temporaries "
                        "(memory_analysis); device_peak_bytes: the allocator's process-wide "
                        "high-water mark so far (null where the device does not report it)")
  return out


# ------------------------------------------------------------------------------------- MoE

def row_moe(sz: dict) -> dict:
  """Dropless MoE train step against dense at equal active parameters (benchmarks/moe.py)."""
  from benchmarks import moe
  args = moe.parse_args([f"--{k}={v}" for k, v in sz.items()] + ["--variants=dense,dropless"])
  cfgs = moe.model_configs(args)
  tokens = moe.make_tokens(args, args.warmup + args.steps)
  steps = {v: moe.build(cfg, args, args.warmup + args.steps) for v, cfg in cfgs.items()}
  for i in range(args.warmup):
    for v in cfgs:
      steps[v](tokens[i])
  times, metrics = {v: [] for v in cfgs}, {v: [] for v in cfgs}
  for r in range(args.steps):  # interleaved, so load drift hits both alike
    for v in cfgs:
      start = time.perf_counter()
      metrics[v].append(steps[v](tokens[args.warmup + r]))
      times[v].append(time.perf_counter() - start)
  tps = args.batch * args.seq_len
  res = {v: moe.summarise(cfgs[v], times[v], metrics[v], tps) for v in cfgs}
  ratio = res["dropless"]["step_time_median_s"] / res["dense"]["step_time_median_s"]
  log(f"moe: dense {res['dense']['step_time_median_s'] * 1e3:.1f} ms, dropless "
      f"{res['dropless']['step_time_median_s'] * 1e3:.1f} ms ({ratio:.2f}x)")
  return {"config": dict(sz, dense_mlp=args.top_k * args.expert_mlp), "dense": res["dense"],
          "dropless": res["dropless"], "ratio_dropless_over_dense": ratio}


# ---------------------------------------------------------------------------------- decode

def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def row_decode(sz: dict, model_spec: dict) -> dict:
  """Output tokens/s of PagedEngine (continuous batching) with `batch` requests at once."""
  from benchmarks.decode_serving import run_continuous
  max_seq_len = sz["prompt"] + sz["new"]
  cfg = model_config(model_spec, max_seq_len, sz["dtype"], sz["dtype"])
  model, tok = build_model(cfg), IdTokenizer()
  out = {"config": dict(sz, num_params=cfg.num_params())}
  for b in sz["batches"]:
    requests = [(ids, sz["new"], "random") for ids in _prompts(b, sz["prompt"], cfg.vocab_size)]
    run = lambda: run_continuous(model, tok, requests, max_seq_len, b, prefix_caching=False)  # noqa: E731
    run()  # compiles every prefill chunk and decode shape the timed run meets
    summary, _ = run()
    out[f"batch_{b}"] = {"tokens_per_s": summary["output_tokens_per_s"],
                         "wall_s": summary["wall_s"], "ttft_p50_s": summary["ttft_s"]["p50"],
                         "tpot_p50_s": summary["tpot_s"]["p50"]}
    log(f"decode batch {b}: {summary['output_tokens_per_s']:.1f} tokens/s")
  return out


# ----------------------------------------------------------------------------- speculative

def layer_skip_draft(target, layers: int):
  """The target's first `layers` blocks with its embeddings and final norm (self-speculation:
  a LayerSkip-style draft that needs no second checkpoint); weights are copied, not trained."""
  from flax import nnx
  draft = build_model(dataclasses.replace(target.cfg, num_layers=layers))
  src = dict(nnx.to_flat_state(nnx.state(target)))
  flat = []
  for path, var in nnx.to_flat_state(nnx.state(draft)):
    value = src[path][...]
    flat.append((path, value[:layers] if path[0] == "blocks" else value))
  nnx.update(draft, nnx.from_flat_state(flat))
  return draft


def row_speculative(sz: dict, model_spec: dict) -> dict:
  """SpeculativeDecoder(ModelDraft) against the target alone (Engine), greedy, batch 1."""
  from infer import Engine, SamplingParams
  from infer.speculative import ModelDraft, SpeculativeDecoder
  max_seq_len = sz["prompt"] + sz["new"]
  cfg = model_config(model_spec, max_seq_len, sz["dtype"], sz["dtype"])
  target = build_model(cfg)
  draft = layer_skip_draft(target, sz["draft_layers"])
  params = SamplingParams(max_tokens=sz["new"], ignore_eos=True)
  engine = Engine(target, IdTokenizer(), max_seq_len=max_seq_len, max_batch=1)
  decoder = SpeculativeDecoder(target, ModelDraft(draft), gamma=sz["gamma"],
                               max_seq_len=max_seq_len)
  methods = {"target_alone": lambda ids: (engine.generate(ids, params)[0].token_ids, None),
             "speculative": lambda ids: decoder.generate(ids, params)}
  prompts = _prompts(sz["prompts"], sz["prompt"], cfg.vocab_size, seed=1)
  for fn in methods.values():
    fn(prompts[0])  # compiles
  walls, tokens, outs, stats = {m: 0.0 for m in methods}, {m: 0 for m in methods}, {}, []
  for ids in prompts:
    for name, fn in methods.items():  # interleaved per prompt
      start = time.perf_counter()
      ids_out, st = fn(ids)
      walls[name] += time.perf_counter() - start
      tokens[name] += len(ids_out)
      outs.setdefault(name, []).append(ids_out)
      if st is not None:
        stats.append(st)
  tps = {m: tokens[m] / walls[m] for m in methods}
  proposed = sum(sum(s.proposed_Y) for s in stats)
  accepted = sum(sum(s.accepted_Y) for s in stats)
  passes = sum(s.target_passes for s in stats)
  out = {"config": dict(sz, target_params=cfg.num_params(),
                        draft_params=draft.cfg.num_params(),
                        draft="the target's first draft_layers blocks (layer skip), random init"),
         "target_alone_tokens_per_s": tps["target_alone"],
         "speculative_tokens_per_s": tps["speculative"],
         "speedup": tps["speculative"] / tps["target_alone"],
         "acceptance_rate": accepted / max(proposed, 1), "proposed": proposed,
         "accepted": accepted, "tokens_per_target_pass": tokens["speculative"] / max(passes, 1),
         "equal_output": outs["speculative"] == outs["target_alone"]}
  log(f"speculative: {out['speedup']:.2f}x, acceptance {out['acceptance_rate']:.2f}")
  return out


# ------------------------------------------------------------------------------- quantized

def row_quant(sz: dict, model_spec: dict) -> dict:
  """Batch-1 greedy decode tokens/s of bf16 weights against INT8 and INT4-g128 (RTN), timed in
  interleaved rounds; each format's best round counts."""
  from benchmarks.quant import decode_runner, decode_speeds
  from models.quant import default_rules
  from infer.quant import quantize_model, weight_bytes
  max_seq_len = sz["prompt"] + sz["new"]
  prompt = _prompts(1, sz["prompt"], model_spec["vocab"], seed=2)[0]
  tok = IdTokenizer()
  out = {"config": dict(sz, method="round-to-nearest, fit_groups; INT4 rows keep the "
                        "embeddings/LM head at INT8 (benchmarks/quant.py's 'auto')")}
  runners = {}
  for label, fmt in (("bf16", None), ("int8", "int8"), ("int4", "int4-g128")):
    if fmt is None:  # bf16 weights and compute
      model = build_model(model_config(model_spec, max_seq_len, "bfloat16", "bfloat16"))
    else:  # quantized from the same float32 init, bf16 compute
      model = build_model(model_config(model_spec, max_seq_len, "bfloat16"))
      emb = "int8" if fmt.startswith("int4") else "same"
      quantize_model(model, default_rules(fmt, embeddings=emb), fit_groups=True)
    runners[label] = decode_runner(model, tok, prompt, sz["new"])
    out[label] = {"weight_bytes": weight_bytes(model), "format": fmt or "bfloat16"}
  speeds, rounds = decode_speeds(runners, sz["repeats"], 0.0)
  out["config"]["rounds"] = rounds
  for label, tps in speeds.items():
    out[label]["tokens_per_s"] = max(tps)
    log(f"quant {label}: {max(tps):.1f} tokens/s")
  for label in ("int8", "int4"):
    out[label]["speedup_over_bf16"] = out[label]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
  return out
