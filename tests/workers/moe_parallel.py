"""Worker: a tiny MoE model under expert parallelism vs one device.

Run in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8.
argv: OUT.json. For every case in CASES it compares with one device (same
moe_impl, same initial parameters, no mesh axes) the logits, the dropped
choices and the gradient of the training loss (token cross-entropy + router
losses, as train/step.py computes it) on one batch, and for some cases 10
steps of jit_train_step. Writes
  {case: {"logits": {"rel", "abs", "allclose"}, "grads": {path: rel},
          "dropped", "base_dropped",
          and when trained here: "losses", "base_losses", "param_rel_diff": {path: rel},
          "collectives": {kind: count, and "moe all-to-all forward"/"backward": the MoE
          layer's own}, "drop_rate": [...], "base_loads": [...]}}
where rel is max |a - b| / max |b| and abs is max |a - b| against one device,
and "allclose" is np.allclose(logits, one device's, rtol=1e-5, atol=1e-6).
"""

import collections
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import parallel
from layouts import COLLECTIVE, MOE_ALL_TO_ALL, MOE_MODEL, OPT, STEPS
from models import Transformer
from train.moe_metrics import router_loss
from train.optimizer import make_optimizer
from train.state import split_abstract_model, create_train_state
from train.step import forward_loss, jit_train_step

# The no-drop capacity case: C = ceil(ceil(T*k/E) * 4) = T slots per expert per sequence, so no
# choice can drop (a token picks an expert at most once) and EP must equal one device.
NO_DROP = 4.0
# name: (model overrides, layout, mesh sizes, train 10 steps here). The dropless layouts'
# 10 steps run in layouts.py (conftest.LAYOUTS "expert" and "fsdp+expert", same MOE_MODEL),
# which compiles them anyway for the golden files.
CASES = {
    "dropless_expert": (dict(moe_impl="dropless"), "expert", dict(data=2, expert=4), False),
    "dropless_fsdp_expert": (dict(moe_impl="dropless"), "fsdp+expert", dict(fsdp=2, expert=4),
                             False),
    "capacity_expert": (dict(moe_impl="capacity", capacity_factor=NO_DROP), "expert",
                        dict(data=2, expert=4), True),
    # Capacity groups are single sequences, so even the dropped choices do not depend on
    # how the batch is split.
    "capacity_drops_expert": (dict(moe_impl="capacity", capacity_factor=1.0), "expert",
                              dict(data=2, expert=4), False),
    # Sequences split over `sequence`: the layer gathers whole sequences, so the same drops.
    "capacity_drops_sequence_expert": (dict(moe_impl="capacity", capacity_factor=1.0),
                                       "sequence+expert", dict(sequence=2, expert=4), False),
}


def batches(cfg):
  """Rows of two packed documents, some ending in padding (segment id 0)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, cfg.vocab_size, (8, 33)).astype(np.int32)
    seg = np.repeat(np.array([[1] * 20 + [2] * 12], np.int32), 8, axis=0)
    seg[::3, -5:] = 0
    pos = np.repeat(np.array([list(range(20)) + list(range(12))], np.int32), 8, axis=0)
    out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg, positions=pos))
  return out


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def model_params(cfg):
  """The initial parameters, made once and placed by each layout (no init compile per run)."""
  return nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)


def forward_and_grads(cfg, layout_name, mesh, params):
  """Logits and the gradient of the training loss on the first batch."""
  layout = parallel.get_layout(layout_name)
  graphdef = split_abstract_model(cfg)[0]

  def loss(p, batch):
    loss_sum, count, stats = forward_loss(graphdef, p, batch)
    return loss_sum / count + router_loss(cfg, stats)

  def f(p, batch):
    logits, stats = nnx.merge(graphdef, p)(batch["inputs"], batch["positions"],
                                           batch["segment_ids"], return_stats=True)
    return logits, jnp.sum(stats["dropped"]), jax.grad(loss)(p, batch)

  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
    params = jax.device_put(params, parallel.logical_shardings(params, mesh, layout.rules))
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    batch = {k: jax.device_put(v, batch_sharding) for k, v in batches(cfg)[0].items()}
    logits, dropped, grads = jax.jit(f)(params, batch)
  return np.asarray(logits), float(dropped), {
      jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}


def train(cfg, layout_name, mesh, params):
  """10 compiled steps as in layouts.py: (losses, final params, collectives, drop rates, loads)."""
  layout = parallel.get_layout(layout_name)
  tx, schedule = make_optimizer(OPT, STEPS)
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
    graphdef, state, shardings = create_train_state(cfg, tx, mesh, seed=0, layout=layout,
                                                    params=params)
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    data = [{k: jax.device_put(v, batch_sharding) for k, v in b.items()} for b in batches(cfg)]
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding).lower(
        state, data[0]).compile()
    hlo = step.as_text()
    collectives = dict(sorted(collections.Counter(
        m.group(1) for m in COLLECTIVE.finditer(hlo)).items()))
    scopes = [m.group(1) for m in MOE_ALL_TO_ALL.finditer(hlo)]
    collectives["moe all-to-all forward"] = sum("transpose(" not in s for s in scopes)
    collectives["moe all-to-all backward"] = sum("transpose(" in s for s in scopes)
    losses, drops = [], []
    for batch in data:
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
      drops.append(float(metrics["moe/drop_rate"]))
    loads = [float(metrics[f"moe/load_e{e}"]) for e in range(cfg.num_experts)]
  params = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  return losses, params, collectives, drops, loads


def main():
  one = parallel.make_mesh({}, devices=jax.devices()[:1])
  params = model_params(MOE_MODEL)[1]  # the same for every moe_impl
  base_forward, base_train, results = {}, {}, {}
  for name, (overrides, layout, sizes, steps) in CASES.items():
    cfg = dataclasses.replace(MOE_MODEL, **overrides)
    mesh = parallel.make_mesh(sizes)
    if cfg not in base_forward:
      base_forward[cfg] = forward_and_grads(cfg, "data_parallel", one, params)
    b_logits, b_dropped, b_grads = base_forward[cfg]
    logits, dropped, grads = forward_and_grads(cfg, layout, mesh, params)
    results[name] = {
        "logits": {"rel": _rel(logits, b_logits), "abs": float(np.max(np.abs(logits - b_logits))),
                   "allclose": bool(np.allclose(logits, b_logits, rtol=1e-5, atol=1e-6))},
        "grads": {k: _rel(grads[k], v) for k, v in b_grads.items()},
        "dropped": dropped, "base_dropped": b_dropped,
    }
    if steps:
      if cfg not in base_train:
        base_train[cfg] = train(cfg, "data_parallel", one, params)
      b_losses, b_params, _, _, b_loads = base_train[cfg]
      losses, final, collectives, drops, _ = train(cfg, layout, mesh, params)
      results[name].update(
          losses=losses, base_losses=b_losses, collectives=collectives, drop_rate=drops,
          base_loads=b_loads,
          param_rel_diff={k: _rel(final[k], v) for k, v in b_params.items()})
  with open(sys.argv[1], "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
