"""Worker: one tiny model trained for 10 steps on 1 device and under each layout.

Run in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8.
argv: OUT.json LAYOUT:MESH [...], MESH like data=2,fsdp=2,tensor=2.
For each layout it compiles the train step once, records what the golden files
hold (parameter and activation specs, collectives in the compiled HLO), then
runs the compiled step and records losses, the largest relative parameter
difference against one device and how many all-to-alls of the MoE layer's
token exchange the step has (forward and backward). Layouts with the `expert` strategy train
MOE_MODEL and are compared with its own one-device run ("single_device_moe");
the others train the dense MODEL ("single_device"). Each layout's result names
its baseline under "baseline".
"""

import collections
import json
import re
import sys

import jax
import numpy as np
from ml_collections import ConfigDict

import parallel
from models import ModelConfig
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_train_step

STEPS = 10
MODEL = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=128, tie_embeddings=False)
# Layouts with the `expert` strategy train this MoE model instead (against its own one-device
# baseline): with the dense MODEL they would split nothing. Router z-loss on, so both router
# losses reach the gradients. Vocabulary 64: every id occurs in every batch. With 256, an id
# seen once gets an embedding gradient of ~1e-8 that nearly cancels; expert parallelism's other
# reduction order changes it by a few percent, and AdamW (eps 1e-8) turns that into a 2e-5
# parameter difference, which says nothing about the layout.
MOE_MODEL = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        mlp_dim=64, tie_embeddings=False, num_experts=8, top_k=2,
                        z_loss_weight=1e-3)
OPT = ConfigDict(dict(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=1.0))
COLLECTIVE = re.compile(
    r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
    r"(?:-start)?\(")
# The MoE layer's token exchange (not e.g. an embedding gather XLA lowers to all-to-all).
MOE_ALL_TO_ALL = re.compile(r"\sall-to-all(?:-start)?\(.*op_name=\"([^\"]*)shard_map/all_to_all\"")


def batches(vocab_size: int = MODEL.vocab_size):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, vocab_size, (8, 33)).astype(np.int32)
    out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                    segment_ids=np.ones((8, 32), np.int32),
                    positions=np.tile(np.arange(32, dtype=np.int32), (8, 1))))
  return out


def _spec(spec):
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def uses_moe(layout_name: str) -> bool:
  return "expert" in layout_name.split("+")


def run(layout_name: str, mesh, model: ModelConfig = MODEL):
  layout = parallel.get_layout(layout_name)
  tx, schedule = make_optimizer(OPT, STEPS)
  stages = dict(mesh.shape).get("pipeline", 1)
  pipeline = parallel.PipelineConfig(stages, microbatches=2) if stages > 1 else None
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh), parallel.pipeline_schedule(pipeline):
    graphdef, state, shardings = create_train_state(model, tx, mesh, seed=0, layout=layout)
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    data = [{k: jax.device_put(v, batch_sharding) for k, v in b.items()}
            for b in batches(model.vocab_size)]
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding).lower(
        state, data[0]).compile()
    losses = []
    for batch in data:
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  golden = {
      "mesh": {k: v for k, v in mesh.shape.items() if v > 1},
      "params": {jax.tree_util.keystr(p): _spec(x.sharding.spec)
                 for p, x in jax.tree_util.tree_leaves_with_path(state["params"])},
      "activations": {name: _spec(parallel.logical_to_spec((name,), layout.rules, mesh))
                      for name in parallel.ACTIVATION_AXES},
      "collectives": dict(sorted(collections.Counter(
          m.group(1) for m in COLLECTIVE.finditer(step.as_text())).items())),
  }
  params = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  scopes = [m.group(1) for m in MOE_ALL_TO_ALL.finditer(step.as_text())]
  moe_all_to_all = {"forward": sum("transpose(" not in s for s in scopes),
                    "backward": sum("transpose(" in s for s in scopes)}
  return losses, params, golden, moe_all_to_all


def main():
  out_path, specs = sys.argv[1], sys.argv[2:]
  one = parallel.make_mesh({}, devices=jax.devices()[:1])
  bases, results = {}, {}
  for spec in specs:
    name, mesh_spec = spec.split(":")
    moe = uses_moe(name)
    base = "single_device_moe" if moe else "single_device"
    model = MOE_MODEL if moe else MODEL
    if base not in bases:
      bases[base] = run("data_parallel", one, model)
      results[base] = {"losses": bases[base][0]}
    base_params = bases[base][1]
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in mesh_spec.split(","))}
    losses, params, golden, moe_all_to_all = run(name, parallel.make_mesh(sizes), model)
    diffs = {k: float(np.max(np.abs(params[k] - v)) / (np.max(np.abs(v)) + 1e-12))
             for k, v in base_params.items()}
    results[spec] = {"losses": losses, "param_rel_diff": diffs, "golden": golden,
                     "baseline": base, "moe_all_to_all": moe_all_to_all}
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
