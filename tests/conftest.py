"""Shared fixtures: a tiny training config over a slice of Tiny Shakespeare, the environment
of the processes tests start, and fixtures built once per test run. Registers the policy for
missing dependencies (tests/deps.py): they fail tests unless --allow-missing-deps is given."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from filelock import FileLock

from deps import pytest_addoption, pytest_configure  # noqa: F401  the missing-deps policy
from experiments.quickstart import get_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare", "input.txt")

# One XLA compilation cache for every test process and the processes they start: many tests
# compile the same tiny programs (one CLI run after another), and on two cores compiling is
# much of the suite's time. Keyed by the program, flags and JAX version, so reuse is exact;
# JAX treats an unreadable entry as a miss.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"meshlm-tests-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# glibc maps each of XLA:CPU's large per-step temporaries (logits over a 49k vocabulary and
# their gradients) afresh, so every step faults them in 4 KiB at a time: for a tiny
# SmolLM2-vocabulary model, 30% of the CPU time went to the kernel. With this tunable glibc
# asks for transparent huge pages instead (README, "Speed on CPU"). Read at process start,
# so it reaches the processes tests start, pytest-xdist's workers included, not this one.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")


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


def build_once(tmp_path_factory, name: str, build) -> str:
  """A directory `build(path)` fills once per test run, whichever pytest-xdist worker asks
  first; the others wait for it and share it. A build that failed is redone by the next."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the run's workers
  path = os.path.join(str(root), "shared-" + name)
  with FileLock(path + ".lock"):
    if not os.path.exists(os.path.join(path, ".built")):
      shutil.rmtree(path, ignore_errors=True)
      os.makedirs(path)
      build(path)
      open(os.path.join(path, ".built"), "w").close()
  return path


QUICKSTART = os.path.join(REPO, "experiments", "quickstart.py")
# The quickstart shrunk to a 1-layer model that trains in seconds from the command line.
TINY_CLI = ["--config.batch_size=4", "--config.seq_len=32", "--config.log_every=2",
            "--config.eval_every=4", "--config.eval_batches=1", "--config.checkpoint_every=2",
            "--config.model.vocab_size=320", "--config.tokenizer.train_vocab_size=320",
            "--config.model.d_model=32", "--config.model.mlp_dim=64",
            "--config.peak_flops_per_device=1e11", "--config.sample.max_new_tokens=0"]


def meshlm(*args, timeout=300, env=None, **kw):
  """`meshlm ARGS` in a fresh process, as a user runs it (captured, text)."""
  env = dict(os.environ if env is None else env, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO, env=env, **kw)


def train_tiny(workdir: str, *extra):
  return meshlm("train", "--config", QUICKSTART, "--workdir", workdir, *TINY_CLI, *extra)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> str:
  """A 1-layer quickstart run of 4 steps, checkpoints at steps 2 and 4; shared: copy it
  before changing anything in it."""
  def build(path):
    out = train_tiny(os.path.join(path, "run"), "--config.steps=4",
                     "--config.model.num_layers=1")
    assert out.returncode == 0, out.stderr[-3000:]
  return os.path.join(build_once(tmp_path_factory, "tiny-cli-run", build), "run")


@pytest.fixture
def shakespeare_slice(tmp_path):
  """The first ~40 KB of Tiny Shakespeare, as its own file."""
  with open(SHAKESPEARE) as f:
    text = f.read()[:40_000]
  path = tmp_path / "shakespeare_slice.txt"
  path.write_text(text)
  return str(path)


# LLVM at -O0 in the processes tests start on fake devices (device_env): they compile tiny
# models under many layouts, where LLVM's optimisation is over half of each compile and buys
# nothing. Not in the test processes themselves, which also sample from SmolLM2: its
# full-vocabulary sorts run ~3x slower at -O0. XLA's own passes (fusion, SPMD partitioning,
# the HLO the golden tests read) run either way. Speed is measured by benchmarks/, not here.
FAST_COMPILE = "--xla_backend_optimization_level=0"


# XLA's CPU runtime runs the fake devices' programs, and the independent collectives within
# them, on one thread pool that by default has a thread per device. A collective blocks its
# thread until every peer arrives, so when the devices reach independent collectives in
# different orders, the blocked threads can leave none for the peers they wait on: CI saw
# this end in XLA's 40 s rendezvous abort (tensor:data=2,tensor=4, seven of eight threads
# blocked in all-reduces). Four threads per device leave room; idle threads cost nothing.
THREADS_PER_DEVICE = 4


def device_env(devices: int, **extra) -> dict:
  """os.environ with `devices` fake CPU devices, for a process a test starts."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} " \
          f"--xla_force_host_platform_device_count={devices}"
  return dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=REPO,
              PJRT_NPROC=str(THREADS_PER_DEVICE * devices), **extra)


EIGHT_DEVICES = device_env(8)

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


def finish_all(procs: list, timeout: float = 600) -> list[str]:
  """The outputs of processes a test started (stdout piped, text), once each has exited 0;
  any still running after `timeout`, or when one fails, is killed."""
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
      p.wait()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


def run_worker(name, *args, timeout=900, env=None):
  """Runs tests/workers/NAME in its own process (8 fake devices by default)."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "workers", name), *args],
                       env=env or EIGHT_DEVICES, capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
  assert out.returncode == 0, out.stderr[-4000:]
  return out


@pytest.fixture(scope="session")
def layout_results(tmp_path_factory):
  """Every layout in LAYOUTS, compiled and trained once per test run."""
  path = build_once(tmp_path_factory, "layouts",
                    lambda d: run_worker("layouts.py", os.path.join(d, "layouts.json"), *LAYOUTS))
  with open(os.path.join(path, "layouts.json")) as f:
    return json.load(f)
