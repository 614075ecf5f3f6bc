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
from infer.quant import quantize_model
from models import ModelConfig, create_model, layer_weights
from models.quant import default_rules
from train.defaults import model_config_from
from train.plan.aot import compiled_facts
from train.plan.compile_target import run_deviceless
from train.plan.targets import resolve
from train.state import split_abstract_model


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pool",))
def decode_step(graphdef, state, pool, token_B, start_B, table_BY):
  """Logits for one new token per row, and the pool with its keys and values written."""
  model = layer_weights.merge(graphdef, state)
  ones_B1 = jnp.ones((token_B.shape[0], 1), jnp.int32)
  return paged.forward(model, pool, token_B[:, None], ones_B1, start_B, table_BY)


def compile_decode(model_cfg: ModelConfig, devices, batch: int = 1, context: int = 1024,
                   page_size: int = 16, kv_dtype: str | None = None, model=None,
                   unroll_layers: bool = False, hlo: bool = False) -> dict:
  """The decode step's compiled facts on one of `devices` (module docstring). `model`: a
  (graphdef, state) pair to compile instead of `model_cfg`'s float model, e.g. a quantized
  one (its state's arrays or their shapes); `unroll_layers`: the layers as a Python loop
  (models/layer_weights.py), so that the cost model counts every one; `hlo` adds the
  optimized HLO text."""
  if context < 1 or batch < 1 or context % page_size:
    raise ValueError(f"decode compile: batch={batch}, context={context} must be >= 1 and "
                     f"context a multiple of page_size={page_size}")
  mesh = parallel.make_mesh({"data": 1}, list(devices)[:1])
  replicated = NamedSharding(mesh, PartitionSpec())
  blocks = context // page_size + 1  # room for the new token's page
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
  with jax.set_mesh(mesh):
    graphdef, state = model if model is not None else split_abstract_model(model_cfg)
    if unroll_layers:
      state = jax.eval_shape(layer_weights.unstack, state)
    state = jax.tree.map(abstract, state)
    pool = jax.eval_shape(lambda: paged.init_pool(model_cfg, batch * blocks + 1, page_size,
                                                  kv_dtype))
    pool = jax.tree.map(abstract, pool)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731
    compiled = decode_step.lower(graphdef, state, pool, ints(batch), ints(batch),
                                 ints(batch, blocks)).compile()
  out = dict(compiled_facts(compiled), platform=parallel.platform(mesh),
             device_kind=parallel.device_kind(mesh), batch=batch, context=context,
             kv_dtype=kv_dtype)
  if hlo:
    out["hlo"] = compiled.as_text()
  return out


def quantized_model(model_cfg: ModelConfig, fmt: str):
  """(graphdef, the state's shapes) of `model_cfg`'s model with every projection and the
  embeddings in `fmt` (models.quant.default_rules), quantized round-to-nearest from random
  weights on the host's CPU: the layout a checkpoint quantized so has."""
  with jax.default_device(jax.devices("cpu")[0]):
    model = create_model(model_cfg, nnx.Rngs(0))
    quantize_model(model, default_rules(fmt, "same"))
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def seconds_estimate(facts: dict) -> float | None:
  """The compiler's time estimate of a step (`optimal_seconds`), with the −1 s that libtpu's
  cost model counts for each of its ConcatBitcast custom calls (it has none for them) added
  back: every decode compile here came out at −n s plus milliseconds for n such calls. None
  where no cost model or still not positive."""
  cost = facts.get("cost") or {}
  if "optimal_seconds" not in cost:
    return None
  seconds = cost["optimal_seconds"] + facts["kernels"].get("ConcatBitcast", 0)
  return seconds if seconds > 0 else None


def compile_in_subprocess(config, target: str, batch: int = 1, context: int = 1024,
                          kv_dtype: str | None = None, timeout: float | None = None,
                          quant: str | None = None, unroll_layers: bool = False,
                          hlo: bool = False) -> dict:
  """`compile_decode` of `config`'s model on `target` (train.plan.targets), in a fresh
  interpreter (train.plan.compile_target.run_deviceless); `quant`: its weights quantized to
  that format first (`quantized_model`)."""
  config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  request = dict(config=config, target=target, batch=batch, context=context, kv_dtype=kv_dtype,
                 quant=quant, unroll_layers=unroll_layers, hlo=hlo)
  return run_deviceless("infer.compile_decode", request, f"decode compile for {target}",
                        timeout)


def _main():
  r = json.loads(sys.stdin.read())
  devices = resolve(r["target"]).devices()
  cfg = model_config_from(ConfigDict(r["config"]))
  model = quantized_model(cfg, r["quant"]) if r.get("quant") else None
  out = compile_decode(cfg, devices, r["batch"], r["context"], kv_dtype=r.get("kv_dtype"),
                       model=model, unroll_layers=r.get("unroll_layers", False),
                       hlo=r.get("hlo", False))
  print(json.dumps(dict(out, target=r["target"], quant=r.get("quant"),
                        seconds_estimate=seconds_estimate(out))))


if __name__ == "__main__":
  _main()
