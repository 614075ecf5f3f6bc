"""Expert parallelism: which mesh axes split the experts, and shard_map by logical names.

An MoE layer names its expert dimension `experts`; the active rules decide
which mesh axes (if any) split it. When they do, the layer runs its dispatch,
expert FFNs and combine per device inside `shard_map`, exchanging tokens with
all-to-all over those axes. Tokens stay split as the batch is (`act_batch`,
`act_seq`): outside MoE layers the `expert` axis acts as a data axis.
"""

from typing import Callable, Sequence

import jax

from parallel.rules import logical_to_spec, shards_of


def expert_axes() -> tuple[str, ...] | None:
  """Mesh axes of size > 1 that split logical `experts` under the active rules, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  axes = logical_to_spec(("experts",), mesh=mesh)[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  sizes = dict(mesh.shape)
  axes = tuple(a for a in axes if sizes[a] > 1)
  return axes or None


def expert_parallel_size() -> int:
  return shards_of("experts")


def check_experts_divide(num_experts: int) -> None:
  """Raises ValueError naming both sizes when the expert axes do not split the experts."""
  size = expert_parallel_size()
  if num_experts % size:
    raise ValueError(f"model.num_experts={num_experts} is not divisible by the expert-parallel "
                     f"mesh axes {expert_axes()} of total size {size}")


def shard_map_logical(fn: Callable, in_names: Sequence, out_names) -> Callable:
  """`jax.shard_map` over the ambient mesh, with specs given as logical names.

  `in_names`/`out_names` are (pytrees of) tuples of logical names, one per
  argument/output; shard_map reshards arguments to these specs on entry (e.g.
  gathers FSDP-split expert weights), so callers need not match them.
  """
  mesh = jax.sharding.get_abstract_mesh()
  is_names = lambda n: isinstance(n, tuple) and all(a is None or isinstance(a, str) for a in n)
  to_spec = lambda names: logical_to_spec(names, mesh=mesh)
  in_specs = jax.tree.map(to_spec, tuple(in_names), is_leaf=is_names)
  out_specs = jax.tree.map(to_spec, out_names, is_leaf=is_names)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
