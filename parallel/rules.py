"""Logical-axis rules: the one place where logical names meet mesh axes.

Models name every parameter dimension (`embed`, `heads`, `mlp`, ...) and every
large activation dimension (`act_batch`, `act_seq`, `act_embed`, ...). A rule
set is an ordered list of (logical name, mesh axis | tuple of mesh axes | None);
earlier rules win, and a rule is skipped when its mesh axes are already used by
another dimension of the same tensor, so later rules act as fallbacks (MaxText
style, via `flax.linen.logical_to_mesh_axes`).

A layout is named by joining strategies with '+', e.g. "fsdp+tensor".
"""

import contextlib
import dataclasses
import math
import threading
from typing import Sequence

import jax
from flax import linen, nnx
from jax.sharding import NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "q_lora",
              "kv_lora")
ACTIVATION_AXES = ("act_batch", "act_seq", "act_res_seq", "act_embed", "act_heads",
                   "act_kv_heads", "act_mlp", "act_vocab")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES
BATCH_AXES = ("act_batch", "act_res_seq")  # how a [B, T] input batch is laid out

# Batch rows are split over every data-like axis; `expert` acts as data outside MoE layers.
_BATCH = (("act_batch", ("data", "fsdp", "expert")),)

# Each strategy: (rules for params and activations, extra rules for optimizer state).
STRATEGIES: dict[str, tuple[LogicalRules, LogicalRules]] = {
    # Everything replicated except the batch.
    "data_parallel": ((), ()),
    # ZeRO-1: parameters replicated, optimizer moments sharded over the data axes.
    "zero1": ((), (("embed", ("data", "fsdp")), ("vocab", ("data", "fsdp")))),
    # ZeRO-3: parameters (hence gradients and moments) sharded over `fsdp`,
    # gathered layer by layer in the forward and backward passes.
    # Latent attention's query/key-value latents too: DeepSeek-V3's q_b_proj alone is 38M
    # parameters a layer with no embed axis.
    "fsdp": ((("embed", "fsdp"), ("vocab", "fsdp"), ("q_lora", "fsdp"), ("kv_lora", "fsdp")),
             ()),
    # Megatron: column-parallel QKV/gate/up, row-parallel out/down, vocab-parallel logits.
    "tensor": ((("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
                ("vocab", "tensor"), ("act_heads", "tensor"), ("act_kv_heads", "tensor"),
                ("act_mlp", "tensor"), ("act_vocab", "tensor")), ()),
    # Sequence parallel: the residual stream and norms split along the sequence
    # over `tensor` (Megatron-SP) and `sequence` (context parallel).
    "sequence": ((("act_res_seq", ("sequence", "tensor")), ("act_res_seq", "sequence"),
                  ("act_seq", "sequence")), ()),
    # Expert parallel: expert weights split over `expert` (MoE layers name `experts`).
    "expert": ((("experts", "expert"),), ()),
    # Pipeline: the stacked `layers` axis split into stages.
    "pipeline": ((("layers", "pipeline"),), ()),
}


@dataclasses.dataclass(frozen=True)
class Layout:
  """Rules for parameters/activations, and for optimizer state (which may differ: ZeRO-1)."""
  name: str
  rules: tuple
  opt_rules: tuple


def get_layout(name: str) -> Layout:
  parts = [p.strip() for p in name.split("+") if p.strip()]
  unknown = [p for p in parts if p not in STRATEGIES]
  if not parts or unknown:
    raise ValueError(f"unknown sharding strategy {unknown or name!r} in {name!r}; "
                     f"combine these with '+': {sorted(STRATEGIES)}")
  rules = list(_BATCH)
  opt_rules = []
  for p in parts:
    rules += STRATEGIES[p][0]
    opt_rules += STRATEGIES[p][1]
  return Layout(name, tuple(rules), tuple(opt_rules) + tuple(rules))


def get_rules(name: str) -> LogicalRules:
  return get_layout(name).rules


DATA_PARALLEL = get_rules("data_parallel")

_state = threading.local()


def current_rules() -> LogicalRules:
  return getattr(_state, "rules", DATA_PARALLEL)


@contextlib.contextmanager
def axis_rules(rules: LogicalRules):
  """Makes `rules` the active rule set for activation constraints traced inside."""
  previous = current_rules()
  _state.rules = tuple(rules)
  try:
    yield
  finally:
    _state.rules = previous


def logical_to_spec(names: Sequence[str | None], rules: LogicalRules | None = None,
                    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec, dropping mesh axes the mesh lacks."""
  rules = current_rules() if rules is None else rules
  if mesh is not None:
    present = set(mesh.axis_names)
    filtered = []
    for logical, axes in rules:
      if isinstance(axes, tuple):
        axes = tuple(a for a in axes if a in present) or None
      elif axes is not None and axes not in present:
        axes = None
      filtered.append((logical, axes))
    rules = filtered
  return linen.logical_to_mesh_axes(tuple(names), rules)


def shards_of(name: str) -> int:
  """How many ways the active mesh and rules split logical axis `name` (1 outside a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = logical_to_spec((name,), mesh=mesh)[0]
  axes = (axes,) if isinstance(axes, str) else (axes or ())
  return math.prod(mesh.shape[a] for a in axes)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, mesh=mesh))


def _names(leaf):
  return leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None


def logical_shardings(abstract_tree, mesh: jax.sharding.Mesh, rules: LogicalRules | None = None):
  """NamedShardings for a tree of nnx Variables/arrays from their `out_sharding` metadata.

  Raises a ValueError naming the array, dimension and sizes when a mesh axis
  does not divide the dimension it would split.
  """
  sizes = dict(mesh.shape)

  def one(path, leaf):
    names = _names(leaf)
    spec = logical_to_spec(names, rules, mesh) if names else PartitionSpec()
    shape = getattr(leaf, "shape", ())
    for dim, (axes, length) in enumerate(zip(spec, shape)):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      parts = 1
      for a in axes:
        parts *= sizes[a]
      if length % parts:
        raise ValueError(
            f"{jax.tree_util.keystr(path)}: dimension {dim} ({names[dim]}) of size {length} "
            f"is not divisible by mesh axes {axes} of total size {parts}")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, abstract_tree,
                                          is_leaf=lambda v: isinstance(v, nnx.Variable))
