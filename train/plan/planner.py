"""Layout planner: per-device memory and communication of one training step, from shapes alone.

`Planner(config).estimate(mesh_sizes, sharding)` sizes a layout without devices:
parameters, gradients and optimizer state are the real abstract train state
(`train.state.split_abstract_model`, the real optimizer's `init` under `jax.eval_shape`),
each array divided exactly as `parallel.logical_shardings` shards it on an
`AbstractMesh`. Activations follow the formula below, each tensor divided by
the mesh axes its logical names map to (`parallel.logical_to_spec`).

Activations (per device; c = bytes of model.dtype, f = 4 bytes of float32).
A layer called on r rows of T positions saves, by `model.remat` (the residuals
JAX keeps for this model's backward pass, from `jax.ad_checkpoint`):
  X = r·T·D   (act_batch, act_res_seq, act_embed)    Q = r·T·N·H  (…, act_heads)
  KV = r·T·K·H (…, act_kv_heads)   S = r·N·T·T scores (act_batch, act_kv_heads, act_seq)
  Fm = r·T·F  (…, act_mlp); MoE layers: Fm and the dispatched X scale by top_k·capacity_factor
  none           4X·f + 2X·c + 2Q·c + 2KV·c + S·(f + c) + 6Fm·c (+ the layer's weights cast
                 to c when param_dtype differs, sharded like the weights)
  dots           2X·c + 2Q·c + 2KV·c + S·c + 2Fm·c
  dots_saveable  2X·c + Q·c + 2KV·c + 2Fm·c
  full           X·c
Saved = (layer calls per device) × the above: L calls of r = batch/grad_accum
rows, or with a pipeline (M microbatches, R repeats, P stages) (M·R + P − 1)·L/(R·P)
calls of r = batch/grad_accum/M rows. Transients on top, the loss (for a whole
model call, all M microbatches): logits 3·V·f on CPU, 2.5·V·f on TPU (LOSS_BUFFERS; XLA:CPU's peak holds two
logits-sized buffers, the gradient and the logits or a transposed copy, and
the output table gathered for the gradient's matmuls; the third V stands for
that table, within the calibration bounds below) and final hidden states
3X·f + Xs·(c + f) (the unembedding's input and its gradient, gathered over positions: Xs = X unless sequence parallelism
splits them). With remat=none that plus one layer's score gradients and mask
S·(2f + 1); with a remat policy the larger of the loss and one layer's backward
(what the policy recomputes, the `none` set minus the saved set, plus S·(f + 1)).
Also: gradients (1× the parameters; 2× with grad_accum > 1), with FSDP one
layer's all-gathered weights (c), with a pipeline the microbatch and stage
buffers (M + 1)·X·c, and with a circular pipeline (R > 1) the weights each
iteration picks, saved per iteration (calls × one layer's local weights).
Calibrated against XLA's compiled memory_analysis: estimate / compiled peak
within 0.75–1.25 on every layout of tests/test_planner.py and 0.8–1.2 on those
of tests/test_planner_pipeline.py, when the estimate computes as the CPU backend
does (`compute_dtype`: XLA:CPU runs bfloat16 math in float32, so CPU compiles of bfloat16 models come out above the
accelerator estimate).

Communication (bytes each device sends per step, ring algorithms: all-gather
and reduce-scatter move (n−1)/n of the full array, all-reduce twice that,
all-to-all (n−1)/n of the local array, collective-permute all of it):
  fsdp     all-gather of weights (c) in forward and backward, reduce-scatter of
           gradients (param dtype), over the axes that shard a weight and the batch;
  data     all-reduce of gradients over batch axes that do not shard the weight
           (data, and fsdp/expert where the weight is replicated on them);
  zero1    all-gather of updated parameters over the axes sharding only the optimizer;
  tensor   Megatron: 2 all-reduces of r·T·D·c per layer forward, 2 backward (+2 with
           remat=full), one each for the embedding and unembedding;
  sequence all-gather of K and V per layer forward, reduce-scatter backward;
  pipeline collective-permute of one microbatch's activations per iteration, forward
           and backward; weights are gathered each iteration (× (M·R + P − 1)/R);
  expert   4 all-to-alls (dispatch, combine, forward and backward) per MoE layer.
Gradient-side collectives repeat per grad_accum microbatch.
"""

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from models import xent
from models.attention import AUTO_NAIVE_MAX_SCORES
from parallel.mesh import MESH_AXES, resolve_axis_sizes
from parallel.rules import BATCH_AXES, LOGICAL_AXES, get_layout, logical_shardings, logical_to_spec
from train.defaults import model_config_from
from train.optimizer import make_optimizer
from train.state import split_abstract_model

F32 = 4
GiB = 2 ** 30
# Vocabulary-wide float32 buffers per position that the loss holds at the start of the
# backward pass (module docstring). The TPU compiler keeps fewer: for llama3_8b_pod on v5p it
# held the float32 logits, a half-length float32 buffer and three half-length bfloat16 ones
# (2.25 buffers); 2.5 counts the logits and their gradient in float32 and the gradient again
# in bfloat16 for the unembedding's matmuls. Unmeasured on GPUs: the CPU's count.
LOSS_BUFFERS = {"cpu": 3.0, "gpu": 3.0, "tpu": 2.5}
_X = ("act_batch", "act_res_seq", "act_embed")
_POLICY = {  # per layer: (tensor, dtype 'f'|'c', count); see the module docstring
    "none": (("X", "f", 4), ("X", "c", 2), ("Q", "c", 2), ("KV", "c", 2), ("S", "f", 1),
             ("S", "c", 1), ("Fm", "c", 6)),
    "dots": (("X", "c", 2), ("Q", "c", 2), ("KV", "c", 2), ("S", "c", 1), ("Fm", "c", 2)),
    "dots_saveable": (("X", "c", 2), ("Q", "c", 1), ("KV", "c", 2), ("Fm", "c", 2)),
    "full": (("X", "c", 1),),
}


def _is_var(x):
  return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a plan reads from a config besides the optimizer."""
  model: object          # models.ModelConfig
  batch_size: int
  seq_len: int
  grad_accum: int = 1
  num_experts: int = 0   # model.num_experts (MoE layers replace every MLP)
  top_k: int = 1
  capacity_factor: float = 1.0
  dropless: bool = True  # MoE: a dropless layer's receive buffers hold the worst case
  microbatches: int = 0  # config.pipeline.*: 0 = one per stage
  repeats: int = 1
  schedule: str = "gpipe"


def _get(section, key, default):
  return section.get(key, default) if section is not None else default


def workload_from_config(config: ConfigDict) -> Workload:
  model = model_config_from(config)
  pipe = config.get("pipeline", None)
  # Dropless routes exactly top_k copies of each token; the capacity path pads to its factor.
  factor = model.capacity_factor if model.moe_impl == "capacity" else 1.0
  return Workload(
      model=model, batch_size=int(config.batch_size), seq_len=int(config.seq_len),
      grad_accum=int(config.grad_accum), num_experts=model.num_experts,
      top_k=model.top_k if model.num_experts else 1,
      capacity_factor=factor if model.num_experts else 1.0,
      dropless=model.moe_impl == "dropless",
      microbatches=int(_get(pipe, "microbatches", 0) or 0),
      repeats=int(_get(pipe, "repeats", 1) or 1), schedule=str(_get(pipe, "schedule", "gpipe")))


_FLASH_BLOCK = 512  # models/attention.py's default block_q / block_kv


def _flash(cfg, seq_len: int) -> bool:
  """Whether attention runs a flash kernel (O(T) memory) rather than materialising scores."""
  if cfg.attention_impl == "auto":
    return seq_len * seq_len >= AUTO_NAIVE_MAX_SCORES
  return cfg.attention_impl != "naive"


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _axes(entry) -> tuple:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def pipeline_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
  """Idle fraction of a GPipe/circular schedule: (p − 1) / (m·v + p − 1)."""
  return (stages - 1) / (microbatches * repeats + stages - 1)


class Planner:
  """Estimates for one config (model, batch, optimizer) over any mesh and layout."""

  def __init__(self, config: ConfigDict):
    self.config = config
    self.work = workload_from_config(config)
    _, self.params = split_abstract_model(self.work.model)
    tx, _ = make_optimizer(config.optimizer, int(config.steps))
    self.opt_state = jax.eval_shape(tx.init, self.params)
    self.param_count = sum(math.prod(v.shape) for v in jax.tree.leaves(self.params))

  def estimate(self, mesh_sizes: Mapping[str, int], sharding: str, devices: int | None = None,
               compute_dtype: str | None = None, platform: str = "cpu") -> dict:
    """Per-device bytes and per-step communication; ValueError names any size that does not split.

    `compute_dtype` overrides model.dtype, e.g. "float32" to size what XLA's CPU
    backend compiles for a bfloat16 model (it computes bfloat16 in float32).
    `platform` ("cpu" | "gpu" | "tpu") picks the loss's buffer count (LOSS_BUFFERS).
    """
    if platform not in LOSS_BUFFERS:
      raise ValueError(f"planner platform {platform!r}; choose one of {sorted(LOSS_BUFFERS)}")
    devices = devices or math.prod(s for s in mesh_sizes.values() if s > 0)
    sizes = resolve_axis_sizes(mesh_sizes, devices)
    layout = get_layout(sharding)
    mesh = _abstract_mesh(sizes)
    w, cfg = self.work, self.work.model
    stages = sizes["pipeline"]
    if stages > 1 and "pipeline" not in layout.name.split("+"):
      raise ValueError(f"mesh.pipeline={stages} needs the 'pipeline' strategy in sharding "
                       f"(e.g. 'pipeline+fsdp'), got {sharding!r}")
    rows, m = _check_batch(w, sizes, layout, stages)
    rules = layout.rules
    p_sh = logical_shardings(self.params, mesh, rules)
    o_sh = logical_shardings(self.opt_state, mesh, layout.opt_rules)
    dtype = compute_dtype or cfg.dtype
    c = jnp.dtype(dtype).itemsize
    cast = cfg.param_dtype != dtype

    batch_axes = set(_axes(logical_to_spec(("act_batch",), rules, mesh)[0]))
    batch_axes |= set(_axes(logical_to_spec(("act_seq",), rules, mesh)[0]))
    batch_axes = {a for a in batch_axes if sizes[a] > 1}
    iterations = m * w.repeats + stages - 1 if stages > 1 else 1
    # Weights are gathered once per model call per layer; a pipeline calls each stage per iteration.
    layer_repeats = w.grad_accum * (iterations / w.repeats if stages > 1 else 1)

    mem = dict(params=0, grads=0, optimizer=0)
    comm: dict[tuple[str, str], float] = {}
    layer_params_local = 0.0     # one layer's weights on a device (param dtype)
    layer_params_gathered = 0.0  # ... after the FSDP all-gather
    for (path, v), sh in zip(jax.tree_util.tree_leaves_with_path(self.params, is_leaf=_is_var),
                             jax.tree.leaves(p_sh)):
      names = v.get_metadata().get("out_sharding") or (None,) * len(v.shape)
      local = _nbytes(sh.shard_shape(v.shape), v.dtype)
      mem["params"] += local
      on = {a: n for entry, n in zip(sh.spec, names) for a in _axes(entry) if sizes[a] > 1}
      gather = sorted(a for a, n in on.items() if a in batch_axes and n != "experts")
      reduce = sorted(a for a in batch_axes if a not in on)
      g = math.prod(sizes[a] for a in gather)
      per_layer = "layers" in names
      reps = layer_repeats if per_layer else w.grad_accum
      if gather:
        key = "+".join(gather)
        _add(comm, "all-gather (fsdp weights, fwd+bwd)", key,
             2 * reps * local * g * (c if cast else v.dtype.itemsize) / v.dtype.itemsize
             * (g - 1) / g)
        _add(comm, "reduce-scatter (fsdp grads)", key, reps * local * g * (g - 1) / g)
      if reduce:
        n = math.prod(sizes[a] for a in reduce)
        _add(comm, "all-reduce (grads)", "+".join(reduce), w.grad_accum * 2 * local * (n - 1) / n)
      if per_layer:
        layer_params_local += local / cfg.num_layers * (stages if stages > 1 else 1)
        layer_params_gathered += local * g / cfg.num_layers * (stages if stages > 1 else 1)
    mem["grads"] = mem["params"] * (2 if w.grad_accum > 1 else 1)

    for (path, v), sh in zip(jax.tree_util.tree_leaves_with_path(self.opt_state, is_leaf=_is_var),
                             jax.tree.leaves(o_sh)):
      mem["optimizer"] += _nbytes(sh.shard_shape(v.shape), v.dtype)
    extra = _zero1_gather(self.params, p_sh, self.opt_state, o_sh, sizes)
    for axes, nbytes in extra.items():
      _add(comm, "all-gather (zero1 params)", axes, nbytes)

    # Activations.
    t, d, n_h, k_h, h, f = (w.seq_len, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.mlp_dim)
    routed = w.top_k * w.capacity_factor if w.num_experts else 1
    ep = math.prod(sizes[a] for a in _axes(logical_to_spec(("experts",), rules, mesh)[0]))
    if w.num_experts and w.dropless and ep > 1:
      # Expert parallel dropless: any shard may receive every routed row of all J shards,
      # so its exchange and FFN buffers are sized J x top_k x tokens (models/moe_dispatch.py).
      routed = w.top_k * ep
    tensors = {
        "X": ((rows, t, d), _X),
        "Xs": ((rows, t, d), ("act_batch", "act_seq", "act_embed")),  # gathered for matmuls
        "Q": ((rows, t, n_h, h), ("act_batch", "act_seq", "act_heads", None)),
        "KV": ((rows, t, k_h, h), ("act_batch", "act_seq", "act_kv_heads", None)),
        # Flash kernels keep one [block, block] score tile per head instead of [T, T].
        "S": ((rows, k_h, n_h // k_h, t, t) if not _flash(cfg, t) else
              (rows, k_h, n_h // k_h, min(t, _FLASH_BLOCK), min(t, _FLASH_BLOCK)),
              ("act_batch", "act_kv_heads", None, "act_seq", None)),
        "Fm": ((rows, math.ceil(t * routed), f), ("act_batch", "act_seq", "act_mlp")),
        "V": ((rows, t, cfg.vocab_size), ("act_batch", "act_seq", "act_vocab")),
    }
    loc = {k: _local(s, nm, rules, mesh, sizes) for k, (s, nm) in tensors.items()}
    nbytes = lambda spec: sum(loc[k] * (F32 if dt == "f" else c) * n for k, dt, n in spec)
    weights_c = layer_params_local * c / jnp.dtype(cfg.jnp_param_dtype).itemsize
    moe_extra = 0
    if w.num_experts:  # router logits (f32) and dispatched/combined tokens (c)
      moe_extra = loc["X"] * (w.num_experts / d * F32 + 2 * routed * c)
    per_layer = nbytes(_POLICY[cfg.remat]) + (weights_c if cast and cfg.remat == "none" else 0)
    per_layer += moe_extra if cfg.remat in ("none", "dots") else 0
    calls = iterations * cfg.num_layers / (stages * w.repeats) if stages > 1 else cfg.num_layers
    # Transients: the loss (logits, their gradient, the tables) at the start of the backward
    # pass, and one layer's backward (score gradients, plus what the policy recomputes).
    # The final norm works on the residual stream (X); the unembedding's input (in c) and its
    # gradient (f) are gathered over positions first (Xs; models/embedding.py).
    hidden = loc["X"] * 3 * F32 + loc["Xs"] * (F32 + c)
    if cfg.xent == "chunked" and cfg.arch in ("decoder", "prefix_lm"):
      # models/xent.py: the output table gathered (in c), its gradient's accumulator and one
      # chunk's product with it (c), and one chunk's logits, softmax and gradient (f).
      v_local = _local((cfg.vocab_size,), ("act_vocab",), rules, mesh, sizes)
      b_local = _local((rows,), ("act_batch",), rules, mesh, sizes)
      t_local = _local((t,), ("act_seq",), rules, mesh, sizes)
      chunk = b_local * t_local / xent.num_chunks(b_local, t_local)
      logits = 3 * d * v_local * c + m * (3 * chunk * v_local * F32 + hidden)
    else:
      logits = m * (LOSS_BUFFERS[platform] * loc["V"] * F32 + hidden)
    if cfg.remat == "none":  # score gradients (2 float32 buffers) and the boolean mask
      transient = dict(logits_and_layer_backward=logits + loc["S"] * (2 * F32 + 1))
    else:  # the recomputed scores' buffer is reused for their gradient
      recompute = nbytes(_POLICY["none"]) - nbytes(_POLICY[cfg.remat]) + moe_extra
      transient = dict(logits_or_layer_backward=max(logits, recompute + loc["S"] * (F32 + 1)))
    act = dict(saved_layers=calls * per_layer, **transient)
    if stages > 1:  # the microbatch buffer and the stage buffer
      act["pipeline_buffers"] = (m + 1) * loc["X"] * c
    if stages > 1 and w.repeats > 1:  # each iteration's pick of the stage's weights is saved
      act["pipeline_weights"] = calls * layer_params_local
    if layer_params_gathered > layer_params_local:  # one layer's weights, all-gathered, in c
      act["fsdp_gathered_layer"] = layer_params_gathered * c / jnp.dtype(cfg.jnp_param_dtype).itemsize
    mem["activations"] = sum(act.values())
    mem["batch"] = 4 * 4 * _local((w.batch_size, w.seq_len), BATCH_AXES, rules, mesh, sizes)
    mem["total"] = sum(mem.values())

    # Activation collectives.
    tensor = sizes["tensor"] if any(a == "tensor" for e in logical_to_spec(("act_mlp",), rules, mesh)
                                    for a in _axes(e)) else 1
    x_call = loc["Xs"] * c * w.grad_accum  # one layer call's input, over grad_accum microbatches
    if tensor > 1:
      per = 4 + (2 if cfg.remat == "full" else 0)
      _add(comm, "all-reduce (tensor activations)", "tensor",
           (per * calls + 2 * m) * x_call * 2 * (tensor - 1) / tensor)
    seq = sizes["sequence"] if "sequence" in _axes(logical_to_spec(("act_seq",), rules, mesh)[0]) else 1
    if seq > 1:
      kv = loc["KV"] * c * w.grad_accum * seq
      _add(comm, "all-gather/reduce-scatter (sequence K,V)", "sequence",
           calls * 4 * kv * (seq - 1) / seq)
    if stages > 1:
      _add(comm, "collective-permute (pipeline activations)", "pipeline",
           2 * iterations * loc["X"] * c * w.grad_accum)
    expert = sizes["expert"]
    if w.num_experts and expert > 1:
      per = 4 + (2 if cfg.remat == "full" else 0)
      _add(comm, "all-to-all (expert dispatch/combine)", "expert",
           per * calls * x_call * routed * (expert - 1) / expert)

    unused = [a for a in MESH_AXES if sizes[a] > 1 and not _axis_used(a, rules, layout, mesh)]
    return dict(
        mesh={a: s for a, s in sizes.items() if s > 1} or {"data": 1}, sharding=layout.name,
        devices=math.prod(sizes.values()), rows_per_device=rows // math.prod(
            sizes[a] for a in _axes(logical_to_spec(("act_batch",), rules, mesh)[0])),
        memory=mem, activations=act,
        comm=[dict(collective=k, axes=a, bytes=int(b)) for (k, a), b in sorted(comm.items())],
        comm_total=int(sum(comm.values())),
        pipeline=(dict(stages=stages, microbatches=m, repeats=w.repeats, schedule=w.schedule,
                       bubble=pipeline_bubble(stages, m, w.repeats)) if stages > 1 else None),
        unused_axes=unused,
        detail=dict(local_elements=loc, layer_weights=layer_params_local,
                    layer_weights_gathered=layer_params_gathered, calls=calls, c=c))


def _check_batch(w: Workload, sizes, layout, stages):
  """(rows per model call, microbatches); ValueError naming the sizes that do not split."""
  mesh = _abstract_mesh(sizes)
  shards = math.prod(sizes[a] for a in _axes(logical_to_spec(("act_batch",), layout.rules,
                                                               mesh)[0]))
  if w.batch_size % w.grad_accum:
    raise ValueError(f"batch_size={w.batch_size} does not split into grad_accum={w.grad_accum}")
  rows = w.batch_size // w.grad_accum
  m = 1
  if stages > 1:
    m = w.microbatches or stages
    if m < stages:
      raise ValueError(f"pipeline: {m} microbatches for {stages} stages; need microbatches >= "
                       "stages")
    if w.model.num_layers % (stages * w.repeats):
      raise ValueError(f"pipeline: {w.model.num_layers} layers do not split into {stages} "
                       f"stages x {w.repeats} repeats")
    if rows % m:
      raise ValueError(f"pipeline: a batch of {rows} rows does not split into {m} microbatches")
    rows //= m
  if rows % shards:
    raise ValueError(f"a batch of {rows} rows (batch_size={w.batch_size} / grad_accum="
                     f"{w.grad_accum}{f' / {m} microbatches' if m > 1 else ''}) does not split "
                     f"over the {shards} devices of the batch axes")
  return rows, m

def _local(shape, names, rules, mesh, sizes) -> int:
  """Elements of one device's shard of an activation with these logical names."""
  spec = logical_to_spec(names, rules, mesh)
  n = 1
  for length, entry in zip(shape, tuple(spec) + (None,) * len(shape)):
    n *= -(-length // math.prod(sizes[a] for a in _axes(entry)))
  return n


def _abstract_mesh(sizes):
  return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def _add(comm, kind, axes, nbytes):
  comm[(kind, axes)] = comm.get((kind, axes), 0.0) + nbytes


def _axis_used(axis, rules, layout, mesh) -> bool:
  names = LOGICAL_AXES + ("experts",)
  return any(axis in _axes(logical_to_spec((n,), r, mesh)[0])
             for n in names for r in (rules, layout.opt_rules))


def _zero1_gather(params, p_sh, opt_state, o_sh, sizes) -> dict:
  """Bytes of updated parameters all-gathered where the optimizer is sharded more than the weights."""
  opt_axes = {}
  for (path, v), sh in zip(jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=_is_var),
                           jax.tree.leaves(o_sh)):
    opt_axes[jax.tree_util.keystr(path)] = {a for e in sh.spec for a in _axes(e) if sizes[a] > 1}
  out = {}
  for (path, v), sh in zip(jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var),
                           jax.tree.leaves(p_sh)):
    mine = {a for e in sh.spec for a in _axes(e) if sizes[a] > 1}
    suffix = jax.tree_util.keystr(path)
    sharded = set().union(*[axes for key, axes in opt_axes.items() if key.endswith(suffix)])
    extra = sorted(sharded - mine)
    if extra:
      n = math.prod(sizes[a] for a in extra)
      local = _nbytes(sh.shard_shape(v.shape), v.dtype)
      key = "+".join(extra)
      out[key] = out.get(key, 0) + local * (n - 1) / n
  return out
