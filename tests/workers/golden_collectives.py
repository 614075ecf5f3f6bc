"""Worker: the shardings and collectives of the compiled train step, per layout.

argv: OUT_DIR LAYOUT:MESH [...]. Writes OUT_DIR/<layout>.json with parameter
specs, activation specs (each logical activation name under the layout), and the
count of each collective kind in the compiled step's HLO.
"""

import collections
import json
import os
import re
import sys

import jax
import numpy as np

import parallel
from layout_equivalence import MODEL, OPT, batches
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_train_step

COLLECTIVE = re.compile(
    r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
    r"(?:-start)?\(")


def describe(layout_name: str, mesh) -> dict:
  layout = parallel.get_layout(layout_name)
  tx, schedule = make_optimizer(OPT, 10)
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
    graphdef, state, shardings = create_train_state(MODEL, tx, mesh, seed=0, layout=layout)
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in batches()[0].items()}
    hlo = step.lower(state, batch).compile().as_text()
  counts = collections.Counter(m.group(1) for m in COLLECTIVE.finditer(hlo))
  spec = lambda s: [list(a) if isinstance(a, tuple) else a for a in s.spec]
  params = {jax.tree_util.keystr(p): spec(x.sharding)
            for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  activations = {name: [a if not isinstance(a, tuple) else list(a)
                        for a in parallel.logical_to_spec((name,), layout.rules, mesh)]
                 for name in parallel.ACTIVATION_AXES}
  return {"mesh": {k: v for k, v in mesh.shape.items() if v > 1}, "params": params,
          "activations": activations, "collectives": dict(sorted(counts.items()))}


def main():
  out_dir, specs = sys.argv[1], sys.argv[2:]
  os.makedirs(out_dir, exist_ok=True)
  for spec in specs:
    name, mesh_spec = spec.split(":")
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in mesh_spec.split(","))}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
      json.dump(describe(name, parallel.make_mesh(sizes)), f, indent=1, sort_keys=True)
      f.write("\n")


if __name__ == "__main__":
  main()
