"""Worker: the Engine and PagedEngine on a mesh of 8 fake CPU devices against one device.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8. argv: OUT.json LAYOUT:MESH [...].
A tiny decoder is created once; for each layout its parameters are placed by the layout's
rules (parallel.logical_shardings) and both engines generate greedily, with log-probabilities,
for mixed-length prompts under that mesh and rule set. Records the tokens, log-probabilities,
the parameters' and the KV cache's PartitionSpecs, and the one-device results to compare.
"""

import json
import sys

import jax
from flax import nnx

import parallel
from infer import Engine, SamplingParams, kv_cache
from infer.serving import PagedEngine
from models import ModelConfig, Transformer

# init_std 0.2: logits well separated, so a different summation order cannot flip an argmax
CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=128, max_seq_len=64, init_std=0.2, tie_embeddings=False)
PROMPTS = [[5, 9, 2], list(range(1, 20)), [40], [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8],
           list(range(30, 43)), [1]]
NEW_TOKENS = 10


class Tokens:
  """Token-id prompts only: no text, no special tokens."""
  eos_id = bos_id = None

  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


def generate(model) -> dict:
  params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=True, ignore_eos=True)
  out = {}
  for name, engine in (("engine", Engine(model, Tokens(), max_seq_len=64, max_batch=8)),
                       ("paged", PagedEngine(model, Tokens(), max_seq_len=64, max_batch=8))):
    results = engine.generate(PROMPTS, params)
    out[name] = {"tokens": [r.token_ids for r in results],
                 "logprobs": [list(map(float, r.logprobs)) for r in results]}
    if name == "engine":  # would its prefill pack the prompts into one row?
      requests = [engine._request(p, params) for p in PROMPTS]
      out["packed_prefill"] = engine._packed(requests, 8, 8 * 64, 64) is not None
  return out


def cache_specs() -> dict:
  """The PartitionSpecs a full-batch cache gets from kv_cache.init under the active rules."""
  cache = jax.jit(lambda: kv_cache.init(CFG, 8, 64))()
  return {"k": str(cache.k_LBSKH.sharding.spec),
          "segment_ids": str(cache.segment_ids_BS.sharding.spec)}


def main():
  out_path, specs = sys.argv[1], sys.argv[2:]
  model = Transformer(CFG, nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  results = {"single_device": generate(model)}
  for spec in specs:
    layout_name, mesh_spec = spec.split(":")
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh_spec.split(","))}
    mesh = parallel.make_mesh(sizes)
    layout = parallel.get_layout(layout_name)
    with jax.set_mesh(mesh), parallel.axis_rules(layout.rules):
      shardings = parallel.logical_shardings(state, mesh, layout.rules)
      placed = jax.device_put(state, shardings)
      row = generate(nnx.merge(graphdef, placed))
      row["param_specs"] = sorted({str(s.spec) for s in jax.tree.leaves(shardings)})
      row["cache_specs"] = cache_specs()
    results[spec] = row
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
