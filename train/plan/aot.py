"""Ahead-of-time compile of the real train step on fake CPU devices, from shapes only.

`compile_memory(config, mesh_sizes, sharding)` lowers and compiles
`train.step.train_step` exactly as `train.loop.train` jits it (in/out shardings
from `train.state.state_shardings`, donated state) for abstract inputs
(`jax.eval_shape` and `ShapeDtypeStruct`s: nothing is allocated), and returns
XLA's per-device `memory_analysis()`. It needs as many devices as the mesh; as
`XLA_FLAGS=--xla_force_host_platform_device_count=N` must be set before JAX
starts, `compile_in_subprocess` runs it in a fresh interpreter:

  echo '{"config": {...}, "mesh": {"fsdp": 8}, "sharding": "fsdp"}' | \
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train.plan.aot

which prints one JSON line. The peak a device needs is taken as
argument + output − aliased (donated) + temporaries.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

import parallel
from models.registry import EXTRA_INPUTS
from train.defaults import model_config_from
from train.optimizer import make_optimizer
from train.state import split_abstract_model, state_shardings
from train.step import jit_train_step

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def compile_memory(config, mesh_sizes: Mapping[str, int], sharding: str,
                   devices=None) -> dict:
  """Compiles the train step for `mesh_sizes` on `devices` (default: this process's); per-device
  bytes, and what `compiled_facts` reads off the executable."""
  config = config if isinstance(config, ConfigDict) else ConfigDict(config)
  model_cfg = model_config_from(config)
  mesh = parallel.make_mesh(dict(mesh_sizes), devices)
  layout = parallel.get_layout(sharding)
  tx, schedule = make_optimizer(config.optimizer, int(config.steps))
  graphdef, params = split_abstract_model(model_cfg)
  abstract = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
              "step": jax.ShapeDtypeStruct((), jnp.int32),
              "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
  batch = abstract_batch(config, model_cfg)
  start = time.perf_counter()
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh), _pipeline(config, mesh, sharding,
                                                                        model_cfg):
    shardings = state_shardings(abstract, mesh, layout)
    batch_sharding = NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding,
                          int(config.grad_accum))
    compiled = step.lower(abstract, batch).compile()
  seconds = time.perf_counter() - start
  return dict(compiled_facts(compiled), devices=mesh.size, compile_seconds=round(seconds, 2),
              platform=parallel.platform(mesh), device_kind=parallel.device_kind(mesh))


def compiled_facts(compiled) -> dict:
  """Per-device bytes (memory_analysis), collectives and custom-call kernels (the optimized
  HLO), and the compiler's cost model (cost_analysis; None where the backend has none)."""
  m = compiled.memory_analysis()
  hlo = compiled.as_text()
  # Match the op after its result type, which may be a tuple with spaces (all-to-all).
  counts = {k: len(re.findall(rf"\s{k}(-start)?\(", hlo)) for k in COLLECTIVES}
  return dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
              alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
              peak=peak_bytes(m), collectives={k: v for k, v in counts.items() if v},
              kernels=kernel_counts(hlo), cost=cost_facts(compiled))


def kernel_counts(hlo: str) -> dict[str, int]:
  """Custom-call targets in optimized HLO text, counted: Pallas/Mosaic kernels are
  "tpu_custom_call" on a TPU, Triton and cuDNN calls name themselves on a GPU."""
  counts: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
    counts[target] = counts.get(target, 0) + 1
  return counts


def cost_facts(compiled) -> dict | None:
  """flops, bytes accessed and the compiler's time estimate (`optimal_seconds`, TPU only), as
  the backend counts them: a loop body once, Pallas kernels as almost nothing."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (a backend without a cost model raises or returns None)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost:
    return None
  keep = {"flops": "flops", "bytes accessed": "bytes_accessed",
          "optimal_seconds": "optimal_seconds", "transcendentals": "transcendentals"}
  return {v: float(cost[k]) for k, v in keep.items() if k in cost}


def peak_bytes(m) -> int:
  """One executable's bytes at once, from its memory_analysis(): arguments, outputs (less
  those aliased to donated arguments) and temporaries."""
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def abstract_batch(config, model_cfg) -> dict:
  """The shapes of one global batch: the LM fields [B, T], plus what the architecture and data
  task add (models.registry.EXTRA_INPUTS; an encoder-decoder's sources are [B, source_len])."""
  import jax
  import jax.numpy as jnp

  b, t = int(config.batch_size), int(config.seq_len)
  s = int(config.data.seq2seq.source_len)
  shape = lambda key: (b, s) if key.startswith("enc_") else (b, t)  # noqa: E731
  keys = ["inputs", "targets", "segment_ids", "positions"]
  keys += [k for k in EXTRA_INPUTS[model_cfg.arch] if k != "type_ids"]
  if config.data.task != "lm":
    keys.append("loss_mask")
  return {k: jax.ShapeDtypeStruct(shape(k), jnp.int32) for k in keys}


def _pipeline(config, mesh, sharding, model_cfg):
  """The pipeline schedule training runs for this config (as train/loop.py builds it), or none."""
  section = config.get("pipeline", None) or dict(microbatches=0, repeats=1, schedule="gpipe")
  pcfg = parallel.pipeline_from_config(section, dict(mesh.shape), sharding, model_cfg.num_layers,
                                       int(config.batch_size) // int(config.grad_accum))
  return parallel.pipeline_schedule(pcfg)


def compile_in_subprocess(config, devices: int, mesh_sizes: Mapping[str, int], sharding: str,
                          timeout: float | None = None) -> dict:
  """`compile_memory` in a fresh interpreter with `devices` fake CPU devices."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
             PYTHONPATH=os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
  config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  request = json.dumps(dict(config=config, mesh=dict(mesh_sizes), sharding=sharding))
  out = subprocess.run([sys.executable, "-m", "train.plan.aot"], input=request, env=env, cwd=_REPO,
                       capture_output=True, text=True, timeout=timeout)
  lines = out.stdout.strip().splitlines()
  if out.returncode != 0 or not lines:
    raise RuntimeError(f"AOT compile on {devices} fake devices failed:\n{out.stderr[-3000:]}")
  return json.loads(lines[-1])


def compare(estimate_bytes: float, compiled: dict) -> dict:
  """Estimate vs compiled peak, with their ratio."""
  return dict(estimate=int(estimate_bytes), compiled=int(compiled["peak"]),
              ratio=estimate_bytes / compiled["peak"] if compiled["peak"] else math.inf)


def _main():
  request = json.loads(sys.stdin.read())
  result = compile_memory(request["config"], request["mesh"], request["sharding"])
  print(json.dumps(result))


if __name__ == "__main__":
  _main()
