"""Worker: an FSDP weight gather over a v5p:4x4x4 slice (64 chips), compiled deviceless on
meshlm's mesh (parallel.make_mesh of parallel.compile_devices); prints the collectives. On
libtpu's default (unwrapped) slice or in device-list order the TPU compiler decomposed this
all-gather into an all-reduce, twice the traffic."""

import json
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import parallel

mesh = parallel.make_mesh({"fsdp": 64}, parallel.compile_devices("v5p:4x4x4"))
spec = lambda *axes: NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
w = jax.ShapeDtypeStruct((4096, 14336), jnp.float32, sharding=spec("fsdp", None))
x = jax.ShapeDtypeStruct((64, 8192, 4096), jnp.bfloat16, sharding=spec("fsdp", None, None))
hlo = jax.jit(lambda x, w: jnp.einsum("btd,df->btf", x, w.astype(jnp.bfloat16))).lower(
    x, w).compile().as_text()
print(json.dumps({op: len(re.findall(rf"\s{op}(-start)?\(", hlo))
                  for op in ("all-gather", "all-reduce")}))
