"""Worker: each golden layout's train step compiled for an 8-chip TPU slice (v5e:2x4), deviceless.

argv: OUT.json LAYOUT:MESH [...] (tests/conftest.py's LAYOUTS). The models, optimizer and
batch are tests/workers/layouts.py's; nothing runs, the step is lowered from shapes alone on
compile-only TPU devices, so the TPU compiler's own partitioning and kernels are recorded:
the collectives in the optimized HLO and the Pallas kernel calls. Shardings of parameters and
activations are the rules' and do not depend on the target (the CPU golden files hold them).
"""

import collections
import json
import sys

import jax
import jax.numpy as jnp

import parallel
from layouts import COLLECTIVE, MODEL, MOE_MODEL, OPT, STEPS, uses_moe
from train.optimizer import make_optimizer
from train.plan.aot import kernel_counts
from train.plan.targets import pallas_kernels
from train.state import split_abstract_model, state_shardings
from train.step import jit_train_step

TARGET = "v5e:2x4"


def compile_layout(name: str, sizes: dict, devices) -> dict:
  model = MOE_MODEL if uses_moe(name) else MODEL
  mesh = parallel.make_mesh(sizes, devices)
  layout = parallel.get_layout(name)
  tx, schedule = make_optimizer(OPT, STEPS)
  stages = sizes.get("pipeline", 1)
  pipeline = parallel.PipelineConfig(stages, microbatches=2) if stages > 1 else None
  graphdef, params = split_abstract_model(model)
  abstract = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
              "step": jax.ShapeDtypeStruct((), jnp.int32),
              "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
  batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32)
           for k in ("inputs", "targets", "segment_ids", "positions")}
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh), parallel.pipeline_schedule(pipeline):
    shardings = state_shardings(abstract, mesh, layout)
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    hlo = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding).lower(
        abstract, batch).compile().as_text()
  return {"target": TARGET, "platform": parallel.platform(mesh),
          "mesh": {k: v for k, v in mesh.shape.items() if v > 1},
          "collectives": dict(sorted(collections.Counter(
              m.group(1) for m in COLLECTIVE.finditer(hlo)).items())),
          "pallas_kernels": pallas_kernels(kernel_counts(hlo))}


def main():
  out_path, specs = sys.argv[1], sys.argv[2:]
  devices = parallel.compile_devices(TARGET)
  results = {}
  for spec in specs:
    name, mesh_spec = spec.split(":")
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in mesh_spec.split(","))}
    results[name] = compile_layout(name, sizes, devices)
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
