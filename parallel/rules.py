"""Logical-axis rules: the one place where logical names meet mesh axes.

Models annotate parameters and activations with logical names only
(`batch`, `seq`, `embed`, `heads`, ...). A rule set is an ordered list of
(logical name, mesh axis or None) pairs; a logical name may appear more than
once, and the first mesh axis still unused by the tensor wins (MaxText style),
so a rule set can name fallbacks.
"""

import contextlib
import threading
from typing import Sequence

import jax
from flax import linen
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# Every logical name used by models/. Unlisted names are a bug: see tests.
LOGICAL_AXES = (
    "batch", "seq", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "layers",
)

# Data parallel over the `data` (and, when present, `fsdp`) mesh axes; all parameters replicated.
DATA_PARALLEL: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("seq", None), ("embed", None), ("vocab", None), ("heads", None), ("kv_heads", None),
    ("head_dim", None), ("mlp", None), ("layers", None),
)

PRESETS: dict[str, LogicalRules] = {"data_parallel": DATA_PARALLEL}

_state = threading.local()


def current_rules() -> LogicalRules:
  return getattr(_state, "rules", DATA_PARALLEL)


@contextlib.contextmanager
def axis_rules(rules: LogicalRules):
  """Makes `rules` the active rule set, for both this module and flax's NNX helpers."""
  previous = current_rules()
  _state.rules = tuple(rules)
  try:
    with nnx.logical_axis_rules(list(rules)):
      yield
  finally:
    _state.rules = previous


def get_rules(name: str) -> LogicalRules:
  if name not in PRESETS:
    raise ValueError(f"unknown sharding preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name]


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


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, mesh=mesh))


def logical_shardings(abstract_tree, mesh: jax.sharding.Mesh, rules: LogicalRules | None = None):
  """NamedShardings for a tree of nnx Variables/arrays from their `out_sharding` metadata."""

  def one(leaf):
    names = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
    spec = logical_to_spec(names, rules, mesh) if names else PartitionSpec()
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, abstract_tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
