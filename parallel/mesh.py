"""Builds a device mesh from per-axis sizes; and this process's part of a mesh, for work each
process does on its own rows alone (sampling its share of a step's rollouts,
align/rollout.py), where the run's mesh would make every process take part in every
computation:

  local = process_mesh(mesh)          the sub-mesh of this process's devices (same axis names)
  tree = to_process_mesh(tree, local) global arrays on `mesh` -> the same values on `local`

With one process both return their input unchanged.
"""

import math
from typing import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "pipeline", "expert", "sequence")


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Fills the single -1 axis with the devices left over; checks the product."""
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; mesh axes are {MESH_AXES}")
  sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(
          f"mesh axes {sizes} fix {fixed} devices, which does not divide the {num_devices} devices")
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
        f"mesh {sizes} has {math.prod(sizes.values())} devices but {num_devices} are available")
  return sizes


def make_mesh(sizes: Mapping[str, int], devices=None) -> jax.sharding.Mesh:
  """A mesh over all (or the given) devices, with axes in MESH_AXES order.

  TPU chips driven by one process (one host, or a compile-only slice) are laid out by their
  physical topology (`mesh_utils.create_device_mesh`), so that a mesh axis follows the
  torus's links: in list order, libtpu decomposed an FSDP all-gather over a v5p slice into an
  all-reduce, twice the traffic. Other devices, and TPUs across processes (whose boxes
  `process_mesh` needs along the leading axes), keep the order given."""
  devices = jax.devices() if devices is None else list(np.asarray(devices).flat)
  resolved = resolve_axis_sizes(sizes, len(devices))
  shape = tuple(resolved[a] for a in MESH_AXES)
  if devices[0].platform == "tpu" and jax.process_count() == 1:
    grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
  else:
    grid = np.asarray(devices).reshape(shape)
  return jax.sharding.Mesh(grid, MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def process_mesh(mesh: Mesh) -> Mesh:
  """The devices of `mesh` this process holds, as a mesh with the same axis names (an axis
  that crosses processes keeps only this process's part of it). Raises ValueError where they
  are not one box of the mesh (make_mesh lays processes out along the leading axes)."""
  if jax.process_count() == 1:
    return mesh
  mine_ND = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
  box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in np.nonzero(mine_ND))
  devices = mesh.devices[box]
  if devices.size != int(mine_ND.sum()):
    raise ValueError(f"process {jax.process_index()}'s devices are not a box of the mesh "
                     f"{dict(mesh.shape)}: order the devices by process")
  return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _without(spec: PartitionSpec, axes: set) -> PartitionSpec:
  """`spec` with the mesh axes `axes` removed (those dimensions replicated over them)."""
  def keep(entry):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    kept = tuple(a for a in names if a not in axes)
    return kept[0] if len(kept) == 1 else (kept or None)
  return PartitionSpec(*(keep(e) for e in spec))


def to_process_mesh(tree, local: Mesh):
  """A tree of global arrays (NamedShardings on one mesh) as arrays on `local`, the same
  values: each is first replicated over the mesh axes that cross processes (one resharding
  collective; nothing moves where no such axis splits it), then this process's shards are
  wrapped as an array of `local` without a copy. Every process must call it together."""
  if jax.process_count() == 1:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  for x in leaves:
    if not isinstance(x.sharding, NamedSharding):
      raise ValueError(f"to_process_mesh needs NamedSharding arrays, got {x.sharding}")
  specs = []
  for x in leaves:
    mesh = x.sharding.mesh
    crossing = {a for a in mesh.axis_names if local.shape[a] < mesh.shape[a]}
    specs.append(_without(x.sharding.spec, crossing))
  leaves = jax.device_put(leaves, [NamedSharding(x.sharding.mesh, s)
                                   for x, s in zip(leaves, specs)])
  out = [jax.make_array_from_single_device_arrays(
      x.shape, NamedSharding(local, s), [shard.data for shard in x.addressable_shards])
         for x, s in zip(leaves, specs)]
  return jax.tree.unflatten(treedef, out)
