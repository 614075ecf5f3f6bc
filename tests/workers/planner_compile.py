"""Worker: AOT-compiles the real train step for several layouts of one small config.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=N, N the devices of every mesh.
argv: OUT.json CONFIG.json SPEC [SPEC ...], SPEC like "fsdp+tensor:data=2,fsdp=2,tensor=2:full"
(layout, mesh, model.remat). Writes {SPEC: train.plan.aot.compile_memory(...)}.
"""

import json
import sys

from ml_collections import ConfigDict

from train.plan.aot import compile_memory

out_path, config_path, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(config_path) as f:
  base = json.load(f)
results = {}
for spec in specs:
  layout, mesh, remat = spec.split(":")
  config = ConfigDict(base)
  config.model.remat = remat
  sizes = {k: int(v) for k, v in (p.split("=") for p in mesh.split(","))}
  results[spec] = compile_memory(config, sizes, layout)
  print(spec, results[spec], flush=True)
with open(out_path, "w") as f:
  json.dump(results, f)
