"""Overlap flags: merged without overriding the user's, and accepted by this jaxlib."""

import os
import subprocess
import sys

from parallel.xla_flags import GPU_COLLECTIVE_MATMUL, GPU_OVERLAP, TPU_OVERLAP, overlap_environment


def test_user_flags_win_and_opt_out_works():
  env = overlap_environment({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"})
  assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in env["XLA_FLAGS"]
  assert all(f in env["LIBTPU_INIT_ARGS"] for f in TPU_OVERLAP)
  assert overlap_environment({"MESHLM_XLA_OVERLAP": "0"}) == {}
  assert GPU_COLLECTIVE_MATMUL[0] not in overlap_environment({})["XLA_FLAGS"]
  assert GPU_COLLECTIVE_MATMUL[0] in overlap_environment({"MESHLM_COLLECTIVE_MATMUL": "1"})["XLA_FLAGS"]


def test_gpu_flags_are_known_to_xla():
  """XLA aborts on an unknown flag in XLA_FLAGS, so a typo here would kill every run."""
  flags = " ".join(GPU_OVERLAP + GPU_COLLECTIVE_MATMUL)
  env = dict(os.environ, XLA_FLAGS=flags)
  out = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
