"""Training: the step, gradient accumulation, checkpoint round trip, exact resume, quickstart."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import deps
import parallel
from conftest import tiny_config
from train.defaults import model_config_from
from train import data as data_lib
from train.checkpoint import Checkpointer
from train.loop import train
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_train_step
from train.tokenizer_training import unigram_entropy
from train.workdir import load_tokenizer, load_trained


def _setup(grad_accum=1):
  config = tiny_config()
  model_cfg = model_config_from(config)
  tx, schedule = make_optimizer(config.optimizer, 10)
  mesh = parallel.make_mesh({"data": -1})
  graphdef, state, shardings = create_train_state(model_cfg, tx, mesh, seed=0)
  batch_sharding = jax.sharding.NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
  step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding, grad_accum)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model_cfg.vocab_size, (4, 17)).astype(np.int32)
  segments = np.ones((4, 16), np.int32)
  segments[1, 10:] = 0  # a padded row: padding must not count
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segments,
               positions=np.tile(np.arange(16, dtype=np.int32), (4, 1)))
  return state, step, batch


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_gradient_accumulation_equals_one_big_batch():
  state1, step1, batch = _setup(grad_accum=1)
  state2, step2, _ = _setup(grad_accum=2)
  for _ in range(3):
    state1, m1 = step1(state1, batch)
    state2, m2 = step2(state2, batch)
  np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
  for a, b in zip(_leaves(state1["params"]), _leaves(state2["params"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_train_step_lowers_loss_on_a_fixed_batch():
  state, step, batch = _setup()
  losses = []
  for _ in range(15):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.5, losses
  assert int(state["step"]) == 15


def test_checkpoint_round_trip_restores_identical_state(tmp_path, shakespeare_slice):
  state, step, batch = _setup()
  state, _ = step(state, batch)
  config = tiny_config(**{"data.path": shakespeare_slice})
  tok = __import__("train.tokenizer_training", fromlist=["x"]).train_bpe_tokenizer(
      data_lib.load_split(config.data, "train"), 320)
  it = iter(data_lib.make_dataset(config.data, tok, seq_len=32, batch_size=4, split="train", seed=0))
  next(it)
  ckpt = Checkpointer(str(tmp_path), keep=2)
  ckpt.save(1, state, it, force=True)
  ckpt.wait()
  expected_next = next(it)
  it2 = iter(data_lib.make_dataset(config.data, tok, seq_len=32, batch_size=4, split="train", seed=0))
  template = jax.tree.map(jnp.zeros_like, state)
  restored, restored_step = ckpt.restore(template, it2)
  ckpt.close()
  assert restored_step == 1
  for a, b in zip(_leaves(state), _leaves(restored)):
    np.testing.assert_array_equal(a, b)
  got_next = next(it2)
  for k in expected_next:
    np.testing.assert_array_equal(expected_next[k], got_next[k])


def test_checkpoint_compression_is_an_option_and_either_form_restores(tmp_path):
  """Uncompressed by default; compress=True writes zstd, which a default Checkpointer reads."""
  import grain
  state = {"w_DF": jnp.zeros((64, 1024)), "b_F": jnp.arange(1024.0)}
  data = lambda: iter(grain.MapDataset.range(10).to_iter_dataset())
  sizes = {}
  for compress in (False, True):
    ckpt = Checkpointer(str(tmp_path / f"zstd_{compress}"), keep=1, compress=compress)
    ckpt.save(1, state, data(), force=True)
    ckpt.close()
    sizes[compress] = sum(os.path.getsize(os.path.join(d, f))
                          for d, _, files in os.walk(ckpt.directory) for f in files)
    reader = Checkpointer(str(tmp_path / f"zstd_{compress}"), keep=1)
    restored, _ = reader.restore(jax.tree.map(jnp.zeros_like, state), data())
    reader.close()
    for a, b in zip(_leaves(state), _leaves(restored)):
      np.testing.assert_array_equal(a, b)
  # 256 KB of zeros: stored as they are, or compressed to almost nothing
  assert sizes[False] > 256 * 1024 > 4 * sizes[True], sizes


def test_resume_is_exact(tmp_path, shakespeare_slice):
  """6 steps straight == 3 steps, stop, then resume to 6: same params, same logged losses."""
  config = tiny_config(steps=6, **{"data.path": shakespeare_slice})
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train(config, straight)
  train(config, resumed, stop_at=3)
  assert load_trained(resumed)[2] == 3
  train(config, resumed)
  model_a, _, step_a = load_trained(straight)
  model_b, _, step_b = load_trained(resumed)
  assert step_a == step_b == 6
  for a, b in zip(_leaves(nnx.state(model_a)), _leaves(nnx.state(model_b))):
    np.testing.assert_array_equal(a, b)

  def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return {r["step"]: r["loss"] for r in map(json.loads, f)}

  a, b = losses(straight), losses(resumed)
  assert sorted(a) == [2, 4, 6] and sorted(b) == [2, 3, 4, 6]  # 3: where the first part stopped
  assert {k: b[k] for k in a} == a


def test_quickstart_200_steps_beats_unigram_entropy(tmp_path):
  """The real quickstart config, 200 steps: validation loss well below the unigram entropy."""
  from experiments.quickstart import get_config
  config = get_config()
  config.steps = 200
  config.eval_every = 200
  config.checkpoint_every = 200
  config.peak_flops_per_device = 1e11
  config.sample.max_new_tokens = 0
  last = train(config, str(tmp_path))
  tokenizer = load_tokenizer(str(tmp_path))
  val_docs = data_lib.load_split(config.data, "validation")
  ids = [[tokenizer.bos_id] + tokenizer.encode(d, add_bos=False) + [tokenizer.eos_id]
         for d in val_docs]
  entropy = unigram_entropy(ids)
  print(f"quickstart: val_loss={last['val_loss']:.3f} unigram_entropy={entropy:.3f}")
  assert last["val_loss"] < entropy - 1.0, (last["val_loss"], entropy)


def test_keeps_the_newest_k_plus_every_mth(tmp_path, shakespeare_slice):
  config = tiny_config(steps=12, **{"data.path": shakespeare_slice, "checkpoint_every": 2,
                                    "keep_checkpoints": 2, "keep_checkpoint_every": 4})
  train(config, str(tmp_path))
  steps = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert steps == [4, 8, 10, 12]


IDLE_WRITER_SCRIPT = r"""
import os, sys
import grain, jax, jax.numpy as jnp, numpy as np
from train.checkpoint import Checkpointer
state = {"w_DF": jnp.arange(64 * 256.0).reshape(64, 256), "b_F": jnp.ones(256)}
data = lambda: iter(grain.MapDataset.range(10).to_iter_dataset())
ckpt = Checkpointer(sys.argv[1], keep=2, idle_writer=True)
for step in (1, 2):
  ckpt.save(step, jax.tree.map(lambda x: x + step, state), data(), force=True)
ckpt.wait()
helper = [os.sched_getscheduler(t.native_id) == os.SCHED_IDLE
          for t in __import__("threading").enumerate() if t.name.startswith("meshlm-ckpt")]
ckpt.close()
def comm(tid):
  try:
    with open(f"/proc/self/task/{tid}/comm") as f:
      return f.read()
  except FileNotFoundError:  # the thread exited between the listing and the read
    return ""
pools = [int(t) for t in os.listdir("/proc/self/task") if comm(t).startswith("ts_pool")]
restored, step = Checkpointer(sys.argv[1], keep=2).restore(jax.tree.map(jnp.zeros_like, state), data())
assert step == 2, step
np.testing.assert_array_equal(restored["w_DF"], state["w_DF"] + 2)
print("helper", helper)
print("pools", len(pools), all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in pools))
print("main", os.sched_getscheduler(0) == os.SCHED_OTHER)
"""


def test_idle_writer_saves_at_idle_priority_and_restores(tmp_path):
  """checkpoint_idle_writer: the save's helper thread and TensorStore's pool run SCHED_IDLE, the
  main thread keeps its policy, and the checkpoint restores exactly. In a subprocess: the policy
  of the pool workers cannot be undone and would slow this worker's later tests."""
  import subprocess
  import sys
  if not hasattr(os, "SCHED_IDLE"):
    deps.missing("os.SCHED_IDLE", "it is Linux-only, and so is this test")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", IDLE_WRITER_SCRIPT, str(tmp_path)], cwd=repo,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
  assert lines["helper"] == "[True]", out.stdout
  assert lines["pools"].split()[1] == "True" and int(lines["pools"].split()[0]) > 0, out.stdout
  assert lines["main"] == "True", out.stdout


# --- the loop's hooks and layering ---

TRAIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train")
# Known upward imports, each lazy inside a function: the CLI (moving to cli/) and the
# decontamination check of the data pipeline.
UPWARD_EXEMPT = {"cli.py", "data.py"}


def test_train_imports_nothing_from_align_or_infer():
  import ast
  upward = []
  for name in sorted(os.listdir(TRAIN_DIR)):
    if not name.endswith(".py") or name in UPWARD_EXEMPT:
      continue
    tree = ast.parse(open(os.path.join(TRAIN_DIR, name)).read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        modules = [node.module or ""]
      else:
        continue
      upward += [f"{name}: {m}" for m in modules if m.split(".")[0] in ("align", "infer")]
  assert not upward, upward


class _RefusingGate:
  def validate(self, task):
    raise ValueError("refused")

  def start(self, workdir, plan, model, start_step):
    raise AssertionError("a refused gate never starts")


def test_a_gate_is_validated_before_the_workdir_is_written(tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="refused"):
    train(tiny_config(), str(workdir), gate=_RefusingGate())
  assert not workdir.exists()


def test_a_gated_config_without_a_gate_is_refused(tmp_path):
  config = tiny_config()
  config.eval_gate.every = 2
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="make_gate"):
    train(config, str(workdir))
  assert not workdir.exists()
