"""Worker: a quantized projection (QArray.einsum, a [1, 2048] x [2048, 8192] decode-row matmul)
compiled deviceless for one v5e chip, in each format given; prints JSON facts per format:
bytes the compiler's cost model accesses, the weight's stored bytes, loops, copies of the
codes, and float arrays of the weight's size outside fusions."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import parallel
from benchmarks.quant_decode_tpu import float_weight_copies
from infer.quant.quantize import encode, to_qarray
from models.quant import parse_format
from train.plan.targets import resolve

K, M = 2048, 8192
mesh = parallel.make_mesh({"data": 1}, resolve("v5e:2x2").devices()[:1])
rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
w = np.random.default_rng(0).standard_normal((K, M)).astype(np.float32) * 0.02
facts = {}
for name in sys.argv[1:]:
  fmt = parse_format(name)
  q = to_qarray(encode(w, fmt), fmt, "DF", "D", (K, M))
  with jax.set_mesh(mesh):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), q)
    x = jax.ShapeDtypeStruct((1, K), jnp.bfloat16, sharding=rep)
    compiled = jax.jit(lambda q, x: q.einsum("BD,DF->BF", x, jnp.bfloat16)).lower(
        abstract, x).compile()
  hlo = compiled.as_text()
  facts[name] = dict(
      platform=parallel.platform(mesh), bytes_accessed=compiled.cost_analysis()["bytes accessed"],
      weight_bytes=q.nbytes, loops=len(re.findall(r"\swhile\(", hlo)),
      code_copies=len(re.findall(r"= [su]8\[[\d,]+\]\S* copy\(%q_codes", hlo)),
      float_weights=float_weight_copies(hlo, {K * M}))
print(json.dumps(facts))
