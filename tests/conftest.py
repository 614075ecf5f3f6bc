"""Shared fixtures: a tiny training config over a slice of Tiny Shakespeare."""

import json
import os
import subprocess
import sys

import pytest

from experiments.quickstart import get_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare", "input.txt")


def tiny_config(steps: int = 6, **overrides):
  """The quickstart config shrunk to run in seconds."""
  c = get_config()
  c.steps = steps
  c.batch_size = 4
  c.seq_len = 32
  c.log_every = 2
  c.eval_every = 2
  c.eval_batches = 2
  c.checkpoint_every = 3
  c.async_checkpoints = True
  c.model.vocab_size = 320
  c.model.d_model = 32
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.mlp_dim = 64
  c.tokenizer.train_vocab_size = 320
  c.peak_flops_per_device = 1e11  # skip the CPU peak measurement
  c.sample.max_new_tokens = 0
  for key, value in overrides.items():
    target = c
    *parents, leaf = key.split(".")
    for p in parents:
      target = target[p]
    target[leaf] = value
  return c


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """One process runs the whole suite: drop each module's compiled XLA programs after it, so
  memory does not grow with the number of test files."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def shakespeare_slice(tmp_path):
  """The first ~40 KB of Tiny Shakespeare, as its own file."""
  with open(SHAKESPEARE) as f:
    text = f.read()[:40_000]
  path = tmp_path / "shakespeare_slice.txt"
  path.write_text(text)
  return str(path)


EIGHT_DEVICES = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                     PYTHONPATH=REPO)

# Layouts checked on 8 fake devices (tests/test_parallel.py, tests/test_golden.py,
# tests/test_moe_parallel.py). Layouts with `expert` train a tiny MoE model
# (tests/workers/layouts.py MOE_MODEL: 8 experts, top-2, dropless); the rest a dense one.
LAYOUTS = [
    "data_parallel:data=8",
    "zero1:data=8",
    "fsdp:fsdp=8",
    "tensor:data=4,tensor=2",
    "tensor+sequence:data=2,sequence=2,tensor=2",
    "expert:data=2,expert=4",
    "fsdp+expert:fsdp=2,expert=4",
    "fsdp+tensor:data=2,fsdp=2,tensor=2",
    "pipeline+fsdp:pipeline=2,fsdp=4",  # GPipe, 2 microbatches
]
EXPERT_LAYOUTS = [spec for spec in LAYOUTS if "expert" in spec.split(":")[0].split("+")]


def run_worker(name, *args, timeout=900, env=None):
  """Runs tests/workers/NAME in its own process (8 fake devices by default)."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "workers", name), *args],
                       env=env or EIGHT_DEVICES, capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
  assert out.returncode == 0, out.stderr[-4000:]
  return out


@pytest.fixture(scope="session")
def layout_results(tmp_path_factory):
  """Every layout in LAYOUTS, compiled and trained once per test session."""
  path = str(tmp_path_factory.mktemp("layouts") / "layouts.json")
  run_worker("layouts.py", path, *LAYOUTS)
  with open(path) as f:
    return json.load(f)
