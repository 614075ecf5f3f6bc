"""Worker: pipelined model vs the sequential one on 8 fake CPU devices.

Run in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8.
argv: OUT.json. Writes
  {"forward": {case: {"logits": rel diff, "grads": rel diff}},
   "training": {case: {"losses": [...], "param_rel_diff": {path: rel diff}}},
   "single_device": {"losses": [...]},
   "activation_permutes": {case: count}, "bubble": {case: {"theoretical", "schedule"}}}
where a relative difference is max |a - b| / max |b| against one device, no pipeline.
"""

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

import parallel
from models import ModelConfig, Transformer
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_train_step

STEPS = 10
MODEL = ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    mlp_dim=128, tie_embeddings=False)
OPT = ConfigDict(dict(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=1.0))
# name: (layout, mesh sizes, PipelineConfig)
FORWARD = {
    "gpipe_p4": ("pipeline", dict(pipeline=4, data=2), parallel.PipelineConfig(4, 4)),
    "circular_p2_r2": ("pipeline+fsdp", dict(pipeline=2, fsdp=4),
                       parallel.PipelineConfig(2, 2, 2, "circular")),
}
TRAINING = {
    "gpipe_p2": ("pipeline+fsdp", dict(pipeline=2, fsdp=4), parallel.PipelineConfig(2, 2)),
    "circular_p2_r2": ("pipeline+fsdp", dict(pipeline=2, fsdp=4),
                       parallel.PipelineConfig(2, 2, 2, "circular")),
}
# A collective-permute of one stage slot of the stage buffer, per device [1, B/(M·fsdp), T, D].
STAGE_SLOT_PERMUTE = re.compile(r"= f32\[1,\d+,32,64\]\{[^}]*\} collective-permute\(")


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def batches(n):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    tokens = rng.integers(0, MODEL.vocab_size, (8, 33)).astype(np.int32)
    # Two packed documents per row, so segment ids and positions must follow their microbatch.
    seg = np.repeat(np.array([[1] * 20 + [2] * 12], np.int32), 8, axis=0)
    pos = np.repeat(np.array([list(range(20)) + list(range(12))], np.int32), 8, axis=0)
    out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg, positions=pos))
  return out


@functools.cache
def model_params():
  return nnx.split(Transformer(MODEL, nnx.Rngs(0)), nnx.Param)


def forward_and_grads(mesh, layout_name, pipeline):
  """Logits and gradients of a mean-square loss, params placed by the layout's rules."""
  layout = parallel.get_layout(layout_name)
  batch = batches(1)[0]
  graphdef, params = model_params()

  def f(p, b):
    logits = nnx.merge(graphdef, p)(b["inputs"], b["positions"], b["segment_ids"])
    return jnp.mean(logits ** 2), logits

  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh), parallel.pipeline_schedule(pipeline):
    params = jax.device_put(params, parallel.logical_shardings(params, mesh, layout.rules))
    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, batch)
  return np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(grads)]


def train(mesh, layout_name, pipeline, steps=STEPS):
  """Steps as in layouts.py; also the stage-slot collective-permutes compiled."""
  layout = parallel.get_layout(layout_name)
  tx, schedule = make_optimizer(OPT, STEPS)
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh), parallel.pipeline_schedule(pipeline):
    graphdef, state, shardings = create_train_state(MODEL, tx, mesh, seed=0, layout=layout)
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding)
    data = [{k: jax.device_put(v, batch_sharding) for k, v in b.items()}
            for b in batches(max(steps, 1))]
    hlo = step.lower(state, data[0]).compile().as_text()
    losses = []
    for b in data[:steps]:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
  params = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  return losses, params, len(STAGE_SLOT_PERMUTE.findall(hlo))


def main():
  one = parallel.make_mesh({}, devices=jax.devices()[:1])
  results = {"forward": {}, "training": {}, "activation_permutes": {}, "bubble": {}}

  base_logits, base_grads = forward_and_grads(one, "data_parallel", None)
  for name, (layout, sizes, pipe) in FORWARD.items():
    logits, grads = forward_and_grads(parallel.make_mesh(sizes), layout, pipe)
    results["forward"][name] = {"logits": _rel(logits, base_logits),
                                "grads": max(_rel(g, b) for g, b in zip(grads, base_grads))}

  base_losses, base_params, _ = train(one, "data_parallel", None)
  results["single_device"] = {"losses": base_losses}
  for name, (layout, sizes, pipe) in TRAINING.items():
    losses, params, permute = train(parallel.make_mesh(sizes), layout, pipe)
    results["training"][name] = {
        "losses": losses, "param_rel_diff": {k: _rel(params[k], v) for k, v in base_params.items()}}
    results["activation_permutes"][name] = permute
  # Control: the same layout without a schedule (layers still sharded over `pipeline`).
  results["activation_permutes"]["no_schedule"] = train(
      parallel.make_mesh(dict(pipeline=2, fsdp=4)), "pipeline+fsdp", None, steps=0)[2]

  for name, (_, _, pipe) in {**FORWARD, **TRAINING}.items():
    results["bubble"][name] = {
        "theoretical": parallel.theoretical_bubble(pipe.stages, pipe.microbatches, pipe.repeats),
        "schedule": parallel.measured_bubble(parallel.schedule_table(pipe))}
  with open(sys.argv[1], "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
