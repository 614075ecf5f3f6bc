"""Builds a device mesh from per-axis sizes."""

import math
from typing import Mapping

import jax
import numpy as np

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
  """A mesh over all (or the given) devices, with axes in MESH_AXES order."""
  devices = jax.devices() if devices is None else devices
  resolved = resolve_axis_sizes(sizes, len(devices))
  shape = tuple(resolved[a] for a in MESH_AXES)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
