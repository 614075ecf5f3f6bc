"""Worker: one of 2 processes (1 CPU device each, gloo) running a PeerMonitor while doing
cross-process all-gathers in a loop, until a peer is killed or the test stops it.

argv: PORT PROCESS_ID TIMEOUT_S [STEPS]. Prints "step N" lines. With STEPS both finish
normally: process 1 closes its monitor and waits at exit while process 0 lingers past the
timeout, which must not count as a loss. Without, a collective that fails because the
peer died raises, as in the training loop, and the process then waits in JAX's exit-time
shutdown, where the PeerMonitor must still end it with status 77.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from train.watchdog import PeerMonitor  # noqa: E402

port, process_id, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else None
jax.config.update("jax_cpu_collectives_implementation", "gloo")
# JAX's own heartbeat check is the backstop; it aborts (SIGABRT) between ~0.5x and 1.1x its
# timeout after a peer stops, so 4x the monitor's lets the monitor name the peer first.
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id,
                           heartbeat_timeout_seconds=int(4 * timeout_s))
monitor = PeerMonitor(timeout_s=timeout_s, poll_s=0.25)
step = 0
while steps is None or step < steps:
  gathered = multihost_utils.process_allgather(np.array([step]))
  assert gathered.ravel().tolist() == [step, step], gathered
  print(f"step {step} t={time.monotonic():.3f}", flush=True)
  step += 1
  time.sleep(0.1)
if process_id == 0:  # e.g. a final checkpoint, while process 1 has closed and waits at exit
  time.sleep(timeout_s + 2)
monitor.close()
print("done", flush=True)
