"""Pipeline parallelism: the layer stack split into stages that pass microbatches along.

The model applies its stacked blocks with `run_layers(body, x_BTD, state, aux)`.
With no schedule active that is the plain `jax.lax.scan` over layers (or an
unrolled loop); inside `with pipeline_schedule(PipelineConfig(...))` the same
call runs a pipeline, so switching to a pipeline changes configuration, never
model code.

The pipeline is pure SPMD (as in MaxText). The stacked weights [L, ...] are
viewed as [R, P, L/(R·P), ...]; the stage axis P is sharded over the mesh axes
of the logical `layers` axis (the `pipeline` strategy maps it to the `pipeline`
mesh axis). A stage buffer x_PBTD holds one microbatch per stage. Each
iteration every stage runs its layers on its slot (a vmap over P with
`spmd_axis_name`, so a device runs only its own stages), then the buffer moves
one stage on (`jnp.roll` on the sharded axis: a collective-permute). The last
stage's output goes back to a microbatch buffer x_MBTD, from which stage 0
takes its next input: M·R + P - 1 iterations run every microbatch R times
through all P stages. Gradients are JAX autodiff of this loop, hence exactly
those of the sequential model; the backward pass is the schedule reversed.

Schedules: "gpipe" (R = 1) and "circular" (interleaved virtual stages: layer l
runs on stage (l // (L/(R·P))) % P, shrinking the bubble R-fold). 1F1B is not
offered: it interleaves the backward of one microbatch with the forward of
another, which needs hand-written per-stage VJPs inside the loop instead of
autodiff, and it saves activation memory, not bubble (its bubble is GPipe's).

Letters (see docs/architecture.md): P stages, M microbatches, R repeats
(virtual stages per device), I schedule iterations.
"""

import contextlib
import dataclasses
import math
import threading
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from parallel.rules import constrain, get_layout, logical_to_spec

SCHEDULES = ("gpipe", "circular")
_ACT = ("act_batch", "act_res_seq", "act_embed")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """P stages, M microbatches per batch, R repeats (virtual stages per stage)."""
  stages: int
  microbatches: int
  repeats: int = 1
  schedule: str = "gpipe"

  def __post_init__(self):
    if self.schedule == "1f1b":
      raise ValueError("pipeline schedule '1f1b' is not supported (it needs hand-written "
                       f"backward passes; its bubble equals GPipe's); choose one of {SCHEDULES}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"unknown pipeline schedule {self.schedule!r}; choose one of {SCHEDULES}")
    for name in ("stages", "microbatches", "repeats"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"pipeline.{name} must be a positive integer, got {value!r}")
    if self.schedule == "gpipe" and self.repeats != 1:
      raise ValueError(f"pipeline schedule 'gpipe' runs each stage once, but repeats="
                       f"{self.repeats}; use schedule 'circular' for virtual stages")
    if self.microbatches < self.stages:
      # Circular: stage 0 would need a microbatch back before the last stage is done with it.
      # GPipe: most stages would idle in most iterations.
      raise ValueError(f"pipeline: {self.microbatches} microbatches for {self.stages} stages; "
                       "need microbatches >= stages")

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.stages - 1

  def check(self, num_layers: int, batch_size: int):
    """Raises ValueError naming the sizes when layers or the batch do not split."""
    virtual = self.stages * self.repeats
    if num_layers % virtual:
      raise ValueError(f"pipeline: {num_layers} layers do not split into {self.stages} stages x "
                       f"{self.repeats} repeats = {virtual} virtual stages")
    if batch_size % self.microbatches:
      raise ValueError(f"pipeline: a batch of {batch_size} rows does not split into "
                       f"{self.microbatches} microbatches")


def schedule_table(config: PipelineConfig) -> np.ndarray:
  """item_IP: the work item (repeat·M + microbatch) stage p runs at iteration i; -1 if idle.

  The pipelined loop is driven by this table, so its idle slots are the bubble.
  """
  i_I1 = np.arange(config.iterations)[:, None]
  item_IP = i_I1 - np.arange(config.stages)[None, :]
  item_IP[(item_IP < 0) | (item_IP >= config.microbatches * config.repeats)] = -1
  return item_IP


def theoretical_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
  """Idle fraction of stage time: (P - 1) / (M·R + P - 1)."""
  return (stages - 1) / (microbatches * repeats + stages - 1)


def measured_bubble(item_IP: np.ndarray) -> float:
  """Fraction of (iteration, stage) slots in a schedule that process no real microbatch."""
  return float(np.mean(item_IP < 0))


_state = threading.local()


def current_pipeline() -> PipelineConfig | None:
  return getattr(_state, "config", None)


@contextlib.contextmanager
def pipeline_schedule(config: PipelineConfig | None):
  """Makes `run_layers` traced inside run `config`'s pipeline; None keeps the plain scan.

  Like `axis_rules`, it acts at trace time: enter it around the first call of a jitted step.
  """
  previous = current_pipeline()
  _state.config = config
  try:
    yield
  finally:
    _state.config = previous


def run_layers(body: Callable, x_BTD: jax.Array, state, aux: tuple = (), *, scan: bool = True):
  """x_BTD through every layer: `body(x_BTD, layer_state, *aux) -> (x_BTD, stats)` per layer.

  `state` is the stacked layer state (leading axis L); `aux` are batch-shaped
  arrays (or None) the body needs, e.g. positions and segment ids. `stats` is
  a pytree of per-layer arrays (e.g. MoE router statistics; {} if none);
  returns (x_BTD, stats stacked over L). In a pipeline every stats array is
  averaged over microbatches.
  """
  config = current_pipeline()
  if config is None:
    return _sequential(body, x_BTD, state, aux, scan)
  return _pipelined(config, body, x_BTD, state, aux, scan)


def _num_layers(state) -> int:
  return jax.tree.leaves(state)[0].shape[0]


def _sequential(body, x_BTD, state, aux, scan):
  if scan:
    return jax.lax.scan(lambda x, layer: body(x, layer, *aux), x_BTD, state)
  stats = []
  for i in range(_num_layers(state)):
    x_BTD, s = body(x_BTD, jax.tree.map(lambda a, i=i: a[i], state), *aux)
    stats.append(s)
  return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *stats)


def _stage_axes(stages: int):
  """Mesh axes the stage axis is sharded over (those of logical `layers`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  axes = logical_to_spec(("layers",), mesh=mesh)[0]
  if axes is None:
    return None
  size = math.prod(dict(mesh.shape)[a] for a in ((axes,) if isinstance(axes, str) else axes))
  if stages % size:
    raise ValueError(f"pipeline: {stages} stages cannot be spread over mesh axes {axes} of "
                     f"{size} devices; stages must be a multiple of {size}")
  return axes


def _constrain_axis(a, axis: int, mesh_axes):
  """Pins dimension `axis` to `mesh_axes`, leaving the others to the propagated sharding."""
  if mesh_axes is None:
    return a
  spec = [PartitionSpec.UNCONSTRAINED] * a.ndim
  spec[axis] = mesh_axes
  return jax.lax.with_sharding_constraint(a, PartitionSpec(*spec))


def _pipelined(config: PipelineConfig, body, x_BTD, state, aux, scan):
  p, m, r = config.stages, config.microbatches, config.repeats
  num_layers, batch = _num_layers(state), x_BTD.shape[0]
  config.check(num_layers, batch)
  axes = _stage_axes(p)
  per_stage = num_layers // (p * r)

  # [L, ...] -> [R, P, L/(R·P), ...]: layer l = (repeat·P + stage)·L/(R·P) + j.
  weights = jax.tree.map(
      lambda a: _constrain_axis(a.reshape(r, p, per_stage, *a.shape[1:]), 1, axes), state)

  # Microbatch k holds rows k, k+M, k+2M, ...: a data shard of the batch keeps its own rows.
  def to_micro(a):
    return jnp.moveaxis(a.reshape(batch // m, m, *a.shape[1:]), 1, 0)

  x_MBTD = constrain(to_micro(x_BTD), (None,) + _ACT)
  aux_M = jax.tree.map(to_micro, aux)

  item_IP = schedule_table(config)
  micro_IP = np.where(item_IP < 0, 0, item_IP % m).astype(np.int32)
  repeat_IP = np.clip(item_IP // m, 0, r - 1).astype(np.int32)
  done_I = item_IP[:, p - 1] >= 0  # the last stage finished a real work item

  def run_stage(stage_weights, x_BTD, stage_aux):
    return _sequential(body, x_BTD, stage_weights, stage_aux, scan)

  run_all = jax.vmap(run_stage, spmd_axis_name=axes)

  def iteration(carry, xs):
    x_PBTD, x_MBTD, stats_RP = carry
    micro_P, repeat_P, valid_P, done = xs
    x_PBTD = constrain(x_PBTD.at[0].set(x_MBTD[micro_P[0]]), ("layers",) + _ACT)
    if r == 1:
      stage_weights = jax.tree.map(lambda a: a[0], weights)
    else:  # each stage picks the layers of the repeat it is on
      pick = jax.vmap(lambda a_R, i: a_R[i], in_axes=(1, 0))
      stage_weights = jax.tree.map(lambda a: _constrain_axis(pick(a, repeat_P), 0, axes), weights)
    stage_aux = jax.tree.map(lambda a: a[micro_P], aux_M)
    y_PBTD, stats_P = run_all(stage_weights, x_PBTD, stage_aux)
    y_PBTD = constrain(y_PBTD, ("layers",) + _ACT)
    # Idle stages ran on filler; only real work items count, each in its layers' slot.
    stats_RP = jax.tree.map(
        lambda acc, s: acc.at[repeat_P, jnp.arange(p)].add(
            jnp.where(valid_P.reshape((p,) + (1,) * (s.ndim - 1)), s, 0)), stats_RP, stats_P)
    # Stage s's output feeds stage s+1; the last stage's wraps to slot 0 and is stored.
    x_PBTD = jnp.roll(y_PBTD, 1, axis=0)
    out = jnp.where(done, x_PBTD[0], x_MBTD[micro_P[-1]])
    x_MBTD = constrain(x_MBTD.at[micro_P[-1]].set(out), (None,) + _ACT)
    return (x_PBTD, x_MBTD, stats_RP), None

  x_PBTD = jnp.zeros((p,) + x_MBTD.shape[1:], x_MBTD.dtype)
  stage_shapes = jax.eval_shape(
      lambda w, x, a: run_all(w, x, a)[1],
      jax.tree.map(lambda a: a[0], weights), x_PBTD, jax.tree.map(lambda a: a[:p], aux_M))
  stats_RP = jax.tree.map(lambda s: jnp.zeros((r,) + s.shape, s.dtype), stage_shapes)
  xs = (jnp.asarray(micro_IP), jnp.asarray(repeat_IP), jnp.asarray(item_IP >= 0),
        jnp.asarray(done_I))
  (_, x_MBTD, stats_RP), _ = jax.lax.scan(iteration, (x_PBTD, x_MBTD, stats_RP), xs)
  x_BTD = jnp.moveaxis(x_MBTD, 0, 1).reshape(x_BTD.shape)
  # [R, P, L/(R·P), ...] is layer order; each layer saw every microbatch once.
  stats_L = jax.tree.map(lambda a: a.reshape((num_layers,) + a.shape[3:]) / m, stats_RP)
  return constrain(x_BTD, _ACT), stats_L


def pipeline_from_config(pipeline: Mapping, mesh_sizes: Mapping[str, int], sharding: str,
                         num_layers: int, batch_size: int) -> PipelineConfig | None:
  """The PipelineConfig a training run uses, or None; checks everything before any work.

  `pipeline` has keys microbatches (0: one per stage), repeats, schedule; the
  stage count is the `pipeline` mesh axis size, and `batch_size` is the batch
  one model call sees (the global batch over grad_accum).
  """
  stages = int(mesh_sizes.get("pipeline", 1))
  if stages == 1:
    return None
  if "pipeline" not in get_layout(sharding).name.split("+"):
    raise ValueError(f"mesh.pipeline={stages} needs the 'pipeline' strategy in sharding "
                     f"(e.g. 'pipeline+fsdp'), got {sharding!r}")
  config = PipelineConfig(stages=stages, microbatches=int(pipeline["microbatches"]) or stages,
                          repeats=int(pipeline["repeats"]), schedule=str(pipeline["schedule"]))
  config.check(num_layers, batch_size)
  return config
