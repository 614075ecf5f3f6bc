"""XLA options that hide communication behind compute, per backend.

They must be in the environment before JAX starts its backend, so the CLI calls
`apply_overlap_flags()` first thing. Each list is on by default; set
MESHLM_XLA_OVERLAP=0 to leave the environment untouched, or
MESHLM_COLLECTIVE_MATMUL=1 to add collective matmul (windowed einsum) on GPU,
which only pays off for tensor parallelism on large matmuls.

The GPU options are XLA debug options known to every jaxlib build, so they are
harmless on CPU; the TPU options go to LIBTPU_INIT_ARGS, which only libtpu reads.
CPU has no asynchronous collectives: nothing to enable there.
"""

import os

TPU_OVERLAP = (
    "--xla_tpu_enable_latency_hiding_scheduler=true",
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)

GPU_OVERLAP = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    # Combine small collectives into ~128 MiB ones so fewer launches need hiding.
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
)

GPU_COLLECTIVE_MATMUL = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0",
    "--xla_gpu_multi_streamed_windowed_einsum=true",
)


def _merge(existing: str, flags) -> str:
  """Appends flags whose names the user has not already set (the user wins)."""
  names = {f.split("=")[0] for f in existing.split()}
  extra = [f for f in flags if f.split("=")[0] not in names]
  return " ".join([existing.strip(), *extra]).strip()


def overlap_environment(env: dict[str, str]) -> dict[str, str]:
  """The environment variables to update, given the current environment."""
  if env.get("MESHLM_XLA_OVERLAP", "1") == "0":
    return {}
  gpu = GPU_OVERLAP + (GPU_COLLECTIVE_MATMUL if env.get("MESHLM_COLLECTIVE_MATMUL") == "1" else ())
  return {"LIBTPU_INIT_ARGS": _merge(env.get("LIBTPU_INIT_ARGS", ""), TPU_OVERLAP),
          "XLA_FLAGS": _merge(env.get("XLA_FLAGS", ""), gpu)}


def apply_overlap_flags() -> dict[str, str]:
  """Updates os.environ; call before JAX initialises a backend. Returns what it set."""
  updates = overlap_environment(dict(os.environ))
  os.environ.update(updates)
  return updates
