"""Multi-process start-up through JAX's own runtime (`jax.distributed`).

Where the coordinator and process ids come from, first match wins:
  1. explicit arguments (`meshlm train --coordinator_address H:P --num_processes N --process_id I`)
     or the same in MESHLM_COORDINATOR_ADDRESS / MESHLM_NUM_PROCESSES / MESHLM_PROCESS_ID;
  2. Kubernetes JobSet: JOBSET_NAME, REPLICATED_JOB_NAME, JOB_COMPLETION_INDEX and
     MESHLM_NUM_PROCESSES; the coordinator is pod 0-0 of the job's headless service;
  3. anything JAX detects itself: SLURM (srun), Open MPI, Cloud TPU pods, Kubernetes
     with the `kubernetes` client (`jax.distributed.initialize()` with no arguments).
With none of these, the run is single-process and nothing is initialised.
"""

import os
from typing import Mapping

import jax

DEFAULT_PORT = 8476
# JAX itself aborts every process (SIGABRT) 0.5-1.1x this long after a peer stops
# heart-beating; meshlm's PeerMonitor (train/watchdog.py) must fire well before.
HEARTBEAT_TIMEOUT_S = 100


def detect(env: Mapping[str, str] | None = None, coordinator_address: str | None = None,
           num_processes: int | None = None, process_id: int | None = None) -> dict | None:
  """kwargs for jax.distributed.initialize, {} to let JAX detect, or None for one process."""
  env = os.environ if env is None else env
  address = coordinator_address or env.get("MESHLM_COORDINATOR_ADDRESS")
  count = num_processes or (int(env["MESHLM_NUM_PROCESSES"]) if env.get("MESHLM_NUM_PROCESSES")
                            else None)
  index = process_id if process_id is not None else (
      int(env["MESHLM_PROCESS_ID"]) if env.get("MESHLM_PROCESS_ID") else None)
  if address or index is not None:
    missing = [n for n, v in (("coordinator_address", address), ("num_processes", count),
                              ("process_id", index)) if v is None]
    if missing:
      raise ValueError(f"multi-process start needs coordinator_address, num_processes and "
                       f"process_id; missing {missing}")
    if not 0 <= index < count:
      raise ValueError(f"process_id={index} not in [0, num_processes={count})")
    return dict(coordinator_address=address, num_processes=count, process_id=index)
  if "JOBSET_NAME" in env and "JOB_COMPLETION_INDEX" in env:
    if count is None:
      raise ValueError("JobSet detected: set MESHLM_NUM_PROCESSES to the number of pods")
    jobset, job = env["JOBSET_NAME"], env.get("REPLICATED_JOB_NAME", "workers")
    port = env.get("MESHLM_COORDINATOR_PORT", str(DEFAULT_PORT))
    return dict(coordinator_address=f"{jobset}-{job}-0-0.{jobset}:{port}",
                num_processes=count, process_id=int(env["JOB_COMPLETION_INDEX"]))
  if int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return {}
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return {}
  return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Starts jax.distributed when a multi-process launch is detected; returns whether it did."""
  kwargs = detect(None, coordinator_address, num_processes, process_id)
  if kwargs is None or kwargs.get("num_processes") == 1:
    return False
  # Collectives between CPU devices of different processes go through gloo;
  # GPUs and TPUs use their own and ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
  return True
