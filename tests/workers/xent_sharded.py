"""Worker: the chunked loss (models/xent.py) under a data-like layout on 8 devices keeps each
device's positions on the device: its loop runs over local chunks, no collective moves a
chunk's logits, and the output table is gathered once, in the compute dtype. Prints JSON
facts of the compiled gradient and its values against whole logits."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import parallel
from models import xent

assert jax.device_count() == 8, jax.devices()
xent.CHUNK_ROWS = 32  # 4 chunks of each device's 128 positions
B, T, D, V = 16, 64, 32, 320
MESHES = {"fsdp": {"fsdp": 8}, "sequence": {"data": 2, "sequence": 4},
          "fsdp+tensor": {"fsdp": 4, "tensor": 2}}
layout = sys.argv[1]
mesh = parallel.make_mesh(MESHES[layout])
rules = parallel.get_layout(layout).rules
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
w = jnp.asarray(rng.standard_normal((D, V)) * 0.3, jnp.float32)
targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
weights = jnp.ones((B, T), jnp.float32)

with parallel.axis_rules(rules), jax.set_mesh(mesh):
  spec = lambda *names: NamedSharding(mesh, parallel.logical_to_spec(names, mesh=mesh))  # noqa: E731
  x = jax.device_put(x, spec("act_batch", "act_seq", "act_embed"))
  targets = jax.device_put(targets, spec("act_batch", "act_seq"))
  w = jax.device_put(w, spec("embed", "vocab"))

  def loss(x, w):
    w = parallel.constrain(w.astype(jnp.bfloat16), ("embed", "vocab"))  # as layers.cast does
    return xent.xent_sum(x, w, targets, weights, vocab_major=False,
                         dtype=jnp.bfloat16, chunks=None)

  fn = jax.jit(jax.value_and_grad(loss, (0, 1)))
  compiled = fn.lower(x, w).compile()
  hlo = compiled.as_text()
  value, (gx, gw) = fn(x, w)
  chunks = xent.num_chunks(B // parallel.shards_of("act_batch"),
                           T // parallel.shards_of("act_seq"))

ref = jax.value_and_grad(lambda x, w: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
    jnp.einsum("BTD,DV->BTV", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
               preferred_element_type=jnp.float32), targets)), (0, 1))
want, (rx, rw) = ref(np.asarray(x), np.asarray(w))
collectives = re.findall(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(", hlo)
trips = [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', hlo)]
print(json.dumps(dict(
    chunks=chunks, trips=trips, collectives=[[t, op] for t, op in collectives],
    loss=float(value), want=float(want),
    gx_err=float(jnp.max(jnp.abs(gx.astype(jnp.float32) - rx.astype(jnp.float32)))),
    gx_scale=float(jnp.max(jnp.abs(rx.astype(jnp.float32)))),
    gw_err=float(jnp.max(jnp.abs(gw - rw))), gw_scale=float(jnp.max(jnp.abs(rw))))))
