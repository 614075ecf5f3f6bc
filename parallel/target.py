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

`compile_devices(name)` gives compile-only devices: of a TPU slice by libtpu's name
("v5p:4x4x4"), or of a GPU node by chip and count ("h100x8"), from XLA's description of
that GPU (gpu_targets/, with its source) and the CUDA plugin's compiler.
"""

import os
import re

import jax
from jax.experimental import topologies
from jax.sharding import AbstractMesh, Mesh

PLATFORMS = ("cpu", "gpu", "tpu")
# PJRT spells GPUs by their runtime; a kernel choice only cares that it is a GPU.
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_GPU_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
# GPU node names ("h100x8") to XLA's target configs (gpu_targets/README.md: sources).
GPU_TARGETS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb"}
GPUS_PER_HOST = 8


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
  """Compile-only devices of a target this machine need not have: a TPU slice by libtpu's
  name ("v5e:2x2", "v5p:4x4x4"; libtpu must be installed) or a GPU node, "h100x8" (the CUDA
  plugin must be installed, `pip install 'meshlm[gpu]'`). Raises ValueError naming what is
  missing."""
  gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", topology)
  if gpu:
    return _gpu_devices(gpu.group(1), int(gpu.group(2)))
  return _devices(f"TPU slice {topology}", "libtpu (pip install 'meshlm[tpu]')", platform="tpu",
                  **tpu_slice(topology))


def _devices(name: str, needs: str, **desc) -> list:
  """`topologies.get_topology_desc(**desc).devices`; ValueError naming what is missing: the
  plugin (`needs`: JAX has none registered for the platform) or, in the plugin's own words,
  the name or library it lacks."""
  try:
    return list(topologies.get_topology_desc(**desc).devices)
  except NotImplementedError as e:
    raise ValueError(f"{name} needs {needs}: {e}") from e
  except Exception as e:  # noqa: BLE001 (the plugins raise several kinds)
    raise ValueError(f"cannot make compile-only devices for {name}: "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def tpu_slice(topology: str) -> dict:
  """libtpu's description of the slice named `topology` ("v5p:4x4x4"): as Cloud TPU builds
  it and MaxText's train_compile describes it (its accelerator_to_spec_map): wraparound links
  in every dimension of a 3-D slice (v4, v5p) whose sides are all >= 4, and in a full 16x16
  v5e/v6e pod; megacore chips on v4/v5p; 2x2x1 chips per host. libtpu's defaults (no
  wraparound) describe a different network, for which it compiles other collectives."""
  version, _, grid = topology.partition(":")
  dims = [int(x) for x in grid.split("x")] if grid and grid.replace("x", "").isdigit() else []
  three_d = version in ("v4", "v5p")
  if three_d:
    wrap = (min(dims, default=0) >= 4,) * 3
  else:
    wrap = (dims == [16, 16],) * 2 + (False,)
  return dict(topology_name=topology, chip_config_name="megacore" if three_d else "default",
              chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=wrap)


def _gpu_devices(chip: str, count: int) -> list:
  if chip not in GPU_TARGETS:
    raise ValueError(f"GPU target {chip}x{count}: no XLA target config for {chip!r}; known: "
                     f"{sorted(GPU_TARGETS)}")
  if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
    raise ValueError(f"GPU target {chip}x{count}: give up to {GPUS_PER_HOST} GPUs, or a multiple "
                     f"of {GPUS_PER_HOST} (hosts of {GPUS_PER_HOST})")
  hosts, per_host = (1, count) if count <= GPUS_PER_HOST else (count // GPUS_PER_HOST,
                                                               GPUS_PER_HOST)
  with open(os.path.join(_GPU_SPECS, GPU_TARGETS[chip])) as f:
    spec = f.read()
  return _devices(f"GPU target {chip}x{count}",
                  "JAX's CUDA plugin (pip install 'meshlm[gpu]'; no GPU is needed to compile)",
                  platform="cuda", target_config=spec, topology=f"1x{hosts}x{per_host}")
