"""One decode step compiled for a target's devices, deviceless: a token per row appended to a
paged KV cache (infer/paged.py, the step PagedEngine runs), lowered from shapes alone.

`compile_decode(model_cfg, devices, batch, context)` builds a one-chip mesh from the
first of `devices` (a target's compile-only devices, `parallel.compile_devices`), so
tracing picks the target's kernels (`parallel.platform`: the Pallas paged-attention
kernel on a TPU), and returns what `train.plan.aot.compiled_facts` reads off the
executable: per-chip bytes, custom-call kernels, and the compiler's cost model (bytes
accessed and its time estimate, `optimal_seconds`). One step runs no loop, so the cost
model needs no correction here. Every row's cache holds `context` tokens already.

`compile_in_subprocess` runs it in a fresh interpreter, where the host's JAX stays on
its CPU and libtpu shares its lockfile (train/plan/compile_target.py):

  echo '{"config": {...}, "target": "v5e:2x2", "batch": 1, "context": 1024}' | \
    python -m infer.compile_decode
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

import parallel
from infer import paged
from models import ModelConfig
from train.defaults import model_config_from
from train.plan.aot import compiled_facts
from train.plan.compile_target import run_deviceless
from train.plan.targets import resolve
from train.state import abstract_model


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pool",))
def decode_step(graphdef, state, pool, token_B, start_B, table_BY):
  """Logits for one new token per row, and the pool with its keys and values written."""
  model = nnx.merge(graphdef, state)
  ones_B1 = jnp.ones((token_B.shape[0], 1), jnp.int32)
  return paged.forward(model, pool, token_B[:, None], ones_B1, start_B, table_BY)


def compile_decode(model_cfg: ModelConfig, devices, batch: int = 1, context: int = 1024,
                   page_size: int = 16, kv_dtype: str | None = None) -> dict:
  """The decode step's compiled facts on one of `devices` (module docstring)."""
  if context < 1 or batch < 1 or context % page_size:
    raise ValueError(f"decode compile: batch={batch}, context={context} must be >= 1 and "
                     f"context a multiple of page_size={page_size}")
  mesh = parallel.make_mesh({"data": 1}, list(devices)[:1])
  replicated = NamedSharding(mesh, PartitionSpec())
  blocks = context // page_size + 1  # room for the new token's page
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
  with jax.set_mesh(mesh):
    graphdef, state = abstract_model(model_cfg)
    state = jax.tree.map(abstract, state)
    pool = jax.eval_shape(lambda: paged.init_pool(model_cfg, batch * blocks + 1, page_size,
                                                  kv_dtype))
    pool = jax.tree.map(abstract, pool)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731
    compiled = decode_step.lower(graphdef, state, pool, ints(batch), ints(batch),
                                 ints(batch, blocks)).compile()
  return dict(compiled_facts(compiled), platform=parallel.platform(mesh),
              device_kind=parallel.device_kind(mesh), batch=batch, context=context,
              kv_dtype=kv_dtype)


def compile_in_subprocess(config, target: str, batch: int = 1, context: int = 1024,
                          kv_dtype: str | None = None, timeout: float | None = None) -> dict:
  """`compile_decode` of `config`'s model on `target` (train.plan.targets), in a fresh
  interpreter (train.plan.compile_target.run_deviceless)."""
  config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  request = dict(config=config, target=target, batch=batch, context=context, kv_dtype=kv_dtype)
  return run_deviceless("infer.compile_decode", request, f"decode compile for {target}",
                        timeout)


def _main():
  r = json.loads(sys.stdin.read())
  devices = resolve(r["target"]).devices()
  cfg = model_config_from(ConfigDict(r["config"]))
  print(json.dumps(dict(compile_decode(cfg, devices, r["batch"], r["context"],
                                       kv_dtype=r.get("kv_dtype")), target=r["target"])))


if __name__ == "__main__":
  _main()
