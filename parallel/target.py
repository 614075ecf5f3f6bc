"""Which platform a computation will run on: read from its mesh's devices, never the host's.

A CPU host compiling for a TPU pod (deviceless, `jax.experimental.topologies`) traces the
model with `jax.set_mesh(mesh_of_tpu_devices)`: the kernels must be the TPU's (splash
attention, the grouped matmul, the cache layouts), although `jax.default_backend()` says
"cpu". So every kernel choice asks `platform()`:

  platform(mesh)     the platform of `mesh`'s devices: "cpu", "gpu" or "tpu"
  platform()         of the mesh set by `jax.set_mesh` around the caller (its abstract mesh
                     carries the device kind, also inside `jit` tracing), else of
                     `jax.devices()`, where an unsharded computation runs
  device_kind(mesh)  e.g. "TPU v5 lite", "NVIDIA H100 80GB HBM3", "cpu"

`compile_devices(name)` gives the compile-only devices of a TPU slice by libtpu's name
("v5p:4x4x4").
"""

import jax
from jax.experimental import topologies
from jax.sharding import AbstractMesh, Mesh

PLATFORMS = ("cpu", "gpu", "tpu")
# PJRT spells GPUs by their runtime; a kernel choice only cares that it is a GPU.
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def _device(mesh):
  """One device (or abstract device) of `mesh`, of the surrounding mesh, or of jax.devices()."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if isinstance(mesh, Mesh):
    return mesh.devices.flat[0]
  if isinstance(mesh, AbstractMesh) and not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device
  return jax.devices()[0]


def platform(mesh: Mesh | AbstractMesh | None = None) -> str:
  """"cpu", "gpu" or "tpu": where `mesh` (or the surrounding mesh, else the default devices)
  computes. Raises ValueError for a platform no kernel choice knows."""
  name = _device(mesh).platform.lower()
  name = _ALIASES.get(name, name)
  if name not in PLATFORMS:
    raise ValueError(f"devices of platform {name!r}: meshlm chooses kernels for {PLATFORMS}")
  return name


def device_kind(mesh: Mesh | AbstractMesh | None = None) -> str:
  """The device kind of `mesh` (or the surrounding mesh, else the default devices)."""
  return str(_device(mesh).device_kind)


def compile_devices(topology: str) -> list:
  """Compile-only devices of a TPU slice that this machine need not have: `topology` is
  libtpu's name, e.g. "v5e:2x2", "v5p:4x4x4" (libtpu must be installed). Raises ValueError
  naming what is missing."""
  try:
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  except Exception as e:  # the plugin's own message says which name or library it lacks
    raise ValueError(f"cannot make compile-only TPU devices for {topology!r}: "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
  return list(desc.devices)
