"""Alignment on the shared loop (align/tasks.py): SFT, reward model, DPO (online, cached,
LoRA) and distillation runs of a tiny model on the hh-rlhf slice; the reference's lack of
gradient; exact resume; gradient accumulation; bad data refused before anything trains."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from align.distill import DistillTask
from align.dpo import DPOTask
from align.reward import RewardTask
from align.sft import SFTTask
from experiments.hh_tiny import get_config
from train.loop import train
from train.step import objective_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-slice.jsonl")


def tiny(steps=6, **overrides):
  c = get_config()
  c.data.path = SLICE
  c.data.val_fraction = 0.2
  c.steps, c.batch_size, c.seq_len = steps, 4, 256
  c.log_every, c.eval_every, c.eval_batches, c.checkpoint_every = 2, steps, 8, steps
  c.model.vocab_size, c.tokenizer.train_vocab_size = 512, 512
  c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 32, 2, 2, 1
  c.model.mlp_dim = 64
  c.watchdog.min_seconds = 1e6
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sft_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sft"))
  config = tiny(steps=8)
  last = train(config, workdir, task=SFTTask(config, workdir))
  assert np.isfinite(last["val_loss"]) and last["val_count"] > 0
  return workdir


def test_sft_reports_its_data_and_trains(sft_workdir):
  with open(os.path.join(sft_workdir, "data_report_train.json")) as f:
    report = json.load(f)
  assert report["kept"] > 0 and report["skipped/empty_response"] + report[
      "skipped/unparseable"] > 0  # the slice's bad rows are counted, not trained on
  rows = metrics(sft_workdir)
  assert rows[-1]["loss"] < rows[0]["loss"]


def test_reward_model_from_an_sft_workdir(sft_workdir, tmp_path):
  config = tiny(init_from=sft_workdir, eval_at_start=True)
  last = train(config, str(tmp_path), task=RewardTask(config, str(tmp_path)))
  assert 0.0 <= last["val_accuracy_ci_low"] <= last["val_accuracy"] <= \
      last["val_accuracy_ci_high"] <= 1.0
  assert {"accuracy", "rewards/mean", "rewards/std", "rewards/margin"} <= set(last)


def test_dpo_starts_at_log2_with_zero_rewards_and_moves(sft_workdir, tmp_path):
  config = tiny(init_from=sft_workdir, eval_at_start=True)
  config.optimizer.lr = 3e-3
  train(config, str(tmp_path), task=DPOTask(config, str(tmp_path)))
  rows = metrics(str(tmp_path))
  start = rows[0]  # policy == reference: every implicit reward is exactly 0
  assert start["step"] == 0 and start["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
  assert start["val_rewards/margins"] == 0.0 and start["val_rewards/accuracies"] == 0.0
  assert rows[-1]["val_rewards/margins"] != 0.0
  for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
              "logps/chosen", "logps/rejected"):
    assert key in rows[-1] and "val_" + key in rows[-1]


def test_dpo_cached_reference_matches_online(sft_workdir, tmp_path):
  losses = {}
  for reference in ("online", "cached"):
    workdir = str(tmp_path / reference)
    config = tiny(init_from=sft_workdir)
    config.align.dpo.reference = reference
    losses[reference] = train(config, workdir, task=DPOTask(config, workdir))["loss"]
  assert os.path.exists(str(tmp_path / "cached" / "ref_logps_train.npz"))
  np.testing.assert_allclose(losses["cached"], losses["online"], rtol=1e-5)


def test_dpo_cached_reference_on_a_mesh_matches_one_device(sft_workdir, tmp_path):
  """The cached reference computed on the run's mesh (8 fake devices: data=2 x fsdp=4) holds
  every pair's log-probs as one device computes them, and trains to the losses of the
  online reference on that mesh."""
  import subprocess
  import sys

  from conftest import device_env, finish_all
  from align.data import pair_batch
  from align.datasets import load_pair_split
  from align.logprobs import sequence_logps
  from train.workdir import load_trained
  config = tiny(init_from=sft_workdir)
  run = ["--config.data.path=" + SLICE, "--config.data.val_fraction=0.2", "--config.steps=3",
         "--config.batch_size=8", f"--config.seq_len={config.seq_len}", "--config.log_every=1",
         "--config.eval_every=3", "--config.eval_batches=2", "--config.checkpoint_every=3",
         "--config.init_from=" + sft_workdir, "--config.watchdog.min_seconds=1e6",
         "--config.optimizer.warmup_steps=0", "--config.sharding=fsdp", "--config.mesh.data=2", "--config.mesh.fsdp=4"]
  procs = {ref: subprocess.Popen(
      [sys.executable, "-m", "cli.main", "dpo", "--config",
       os.path.join(REPO, "experiments", "hh_tiny.py"), "--workdir", str(tmp_path / ref), *run,
       f"--config.align.dpo.reference={ref}"], env=device_env(8), cwd=REPO, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for ref in ("online", "cached")}
  for out in finish_all(list(procs.values())):
    assert "8 device(s) in 1 process(es)" in out, out[-2000:]
  with np.load(str(tmp_path / "cached" / "ref_logps_train.npz")) as cached:
    refs_N2 = cached["refs"]
  model, tokenizer, _ = load_trained(sft_workdir)
  pairs, _ = load_pair_split(DPOTask(config, str(tmp_path / "unused")).data_cfg(), tokenizer,
                             "train")
  rows = {k: jnp.asarray(v) for k, v in pair_batch(pairs, config.seq_len).items()}
  logps_2N = np.asarray(sequence_logps(model, rows))  # one device, no mesh
  assert refs_N2.shape == (len(pairs), 2)
  np.testing.assert_allclose(refs_N2, np.stack(np.split(logps_2N, 2), axis=1), rtol=1e-5)
  online, cached = metrics(str(tmp_path / "online")), metrics(str(tmp_path / "cached"))
  assert len(online) == len(cached) == 3
  for key in ("loss", "rewards/margins", "val_loss"):
    np.testing.assert_allclose([r[key] for r in cached if key in r],
                               [r[key] for r in online if key in r], rtol=1e-5, atol=1e-6,
                               err_msg=key)


def test_dpo_reference_gets_no_gradient(sft_workdir, tmp_path):
  """Full fine-tuning keeps the starting params as a frozen reference: d loss / d ref = 0."""
  import parallel
  from train.optimizer import make_optimizer
  from train.setup import plan_run
  from train.task import batch_sharding, to_global
  config = tiny(init_from=sft_workdir)
  task = DPOTask(config, str(tmp_path))
  plan = plan_run(config, str(tmp_path))
  data = task.datasets(plan)
  tx, _ = make_optimizer(config.optimizer, config.steps)
  state, _, frozen, _ = task.init_state(plan, tx, plan.mesh, parallel.get_layout("data_parallel"))
  batch = to_global(next(iter(data["train"])), batch_sharding(plan.mesh))
  policy = jax.tree.map(lambda x: x + 0.01, state["params"])  # policy != reference
  g_ref = jax.grad(lambda f: task.loss(policy, f, batch)[0])(frozen)
  g_policy = jax.grad(lambda p: task.loss(p, frozen, batch)[0])(policy)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(g_ref))
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_policy)) > 0.0


def test_lora_dpo_trains_only_adapters_and_resumes_exactly(sft_workdir, tmp_path):
  config = tiny(steps=6, init_from=sft_workdir)
  config.align.lora_rank = 4
  config.checkpoint_every = 3
  whole = train(config, str(tmp_path / "whole"), task=DPOTask(config, str(tmp_path / "whole")))
  part = str(tmp_path / "part")
  train(config, part, stop_at=3, task=DPOTask(config, part))
  resumed = train(config, part, task=DPOTask(config, part))
  np.testing.assert_allclose(resumed["loss"], whole["loss"], rtol=1e-6)
  train(config, part, task=DPOTask(config, part))  # a finished run started again: a no-op
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(part, "checkpoints")) as m:
    saved = m.restore(m.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]["params"]
  assert set(saved) == {"lora", "extra"}  # the base stays out of the trainable state
  assert any(float(np.max(np.abs(v["b"]))) > 0 for v in saved["lora"].values())


def test_distill_from_a_teacher_workdir(sft_workdir, tmp_path):
  from train.workdir import load_model_config
  teacher = load_model_config(sft_workdir)
  results = {}
  for alpha in (0.0, 0.5):
    workdir = str(tmp_path / f"alpha{alpha}")
    config = tiny(steps=4)
    config.tokenizer.path = sft_workdir
    config.model.vocab_size = teacher.vocab_size
    config.model.d_model, config.model.num_layers = 16, 1
    config.align.distill.teacher = sft_workdir
    config.align.distill.alpha = alpha
    results[alpha] = train(config, workdir, task=DistillTask(config, workdir))
  for last in results.values():
    assert 0.0 <= last["val_top1_agreement"] <= 1.0 and np.isfinite(last["val_ppl"])
  assert results[0.0]["loss"] == pytest.approx(results[0.0]["ce"], rel=1e-5)  # hard labels


def test_mostly_bad_data_is_refused_before_training(sft_workdir, tmp_path):
  bad = tmp_path / "bad.jsonl"
  good = json.dumps({"prompt": "What is two plus two?", "chosen": "Four.",
                     "rejected": "Five."}) + "\n"
  bad.write_text(good + "".join(json.dumps({"chosen": "x"}) + "\n" for _ in range(5)) +
                 "not json\n" + json.dumps({"prompt": "hi", "chosen": "a", "rejected": "a"}) + "\n")
  config = tiny(**{"data.path": str(bad), "data.val_fraction": 0.0})
  config.tokenizer.path = sft_workdir
  workdir = str(tmp_path / "w")
  with pytest.raises(ValueError, match="refusing to train"):
    train(config, workdir, task=DPOTask(config, workdir))
  with open(os.path.join(workdir, "data_report_train.json")) as f:
    report = json.load(f)
  assert report["kept"] == 1 and report["skipped/identical_pair"] == 1
  assert report["skipped/unparseable"] == 1 and report["skipped/missing_fields"] == 5
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_objective_step_accumulation_equals_one_batch():
  params = {"w": jnp.arange(6.0).reshape(3, 2)}
  x = jax.random.normal(jax.random.key(0), (8, 3))

  def loss_fn(p, frozen, batch):
    err = batch["x"] @ p["w"] - frozen["y"]
    return jnp.mean(err ** 2), {"err": jnp.mean(jnp.abs(err))}

  tx = optax.adam(0.1)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jnp.zeros(2, jnp.uint32)}
  frozen = {"y": jnp.ones((2,))}
  outs = [objective_step(state, {"x": x}, frozen, loss_fn=loss_fn, tx=tx,
                         schedule=lambda s: 0.1, grad_accum=a) for a in (1, 2, 4)]
  for new, m in outs[1:]:
    np.testing.assert_allclose(new["params"]["w"], outs[0][0]["params"]["w"], atol=1e-6)
    np.testing.assert_allclose(m["loss"], outs[0][1]["loss"], rtol=1e-6)


def test_cli_sft_then_lora_dpo_then_generate(tmp_path):
  """`meshlm sft`, `meshlm dpo` with LoRA from that workdir, then `meshlm generate` from the
  DPO workdir (its merged model), as a user runs them."""
  import subprocess
  import sys
  config = os.path.join(REPO, "experiments", "hh_tiny.py")
  small = ["--config.data.path=" + SLICE, "--config.data.val_fraction=0.2", "--config.steps=4",
           "--config.batch_size=4", "--config.seq_len=256", "--config.eval_every=4",
           "--config.checkpoint_every=4", "--config.model.d_model=32",
           "--config.model.num_layers=2", "--config.model.vocab_size=512",
           "--config.tokenizer.train_vocab_size=512", "--config.model.mlp_dim=64"]

  def meshlm(*args):
    out = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout

  sft, dpo = str(tmp_path / "sft"), str(tmp_path / "dpo")
  meshlm("sft", "--config", config, "--workdir", sft, *small)
  meshlm("dpo", "--config", config, "--workdir", dpo, *small, "--config.init_from=" + sft,
         "--config.align.lora_rank=4")
  assert os.path.isfile(os.path.join(dpo, "merged", "model_config.json"))
  text = meshlm("generate", "--model", dpo, "--prompt", "Hello", "--max_new_tokens", "4")
  assert text.strip()


@pytest.mark.parametrize("command,key,value,match", [
    ("dpo", "align.dpo.loss_type", "sigmoidd", "loss_type"),
    ("dpo", "align.dpo.beta", 0.0, "beta"),
    ("dpo", "align.dpo.reference", "offline", "reference"),
    ("rm", "align.lora_rank", -1, "lora_rank"),
    ("distill", "align.distill.teacher", "", "teacher"),
])
def test_bad_align_config_is_refused_before_anything_is_written(tmp_path, command, key,
                                                                value, match):
  from models import ConfigError
  from cli.train import make_task
  with pytest.raises(ConfigError, match=match):
    make_task(command, tiny(**{key: value}), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


def test_sft_without_held_out_data(sft_workdir, tmp_path):
  config = tiny(steps=2, init_from=sft_workdir, eval_at_start=True)
  config.data.val_fraction = 0.0
  last = train(config, str(tmp_path), task=SFTTask(config, str(tmp_path)))
  assert last["val_count"] == 0.0 and np.isfinite(last["loss"])


def test_token_weighted_accumulation_equals_one_batch():
  """A token-mean loss over rows holding different token counts: weight_fn makes the
  accumulated update the whole batch's token mean."""
  params = {"w": jnp.ones((3,))}
  x = jax.random.normal(jax.random.key(1), (4, 5, 3))
  mask = jnp.array([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]],
                   jnp.float32)

  def loss_fn(p, frozen, batch):
    err = (batch["x"] @ p["w"] - 1.0) ** 2
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"]), {}

  tx = optax.sgd(0.1)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jnp.zeros(2, jnp.uint32)}
  batch = {"x": x, "mask": mask}
  kw = dict(loss_fn=loss_fn, tx=tx, schedule=lambda s: 0.1)
  one, m1 = objective_step(state, batch, None, **kw)
  two, m2 = objective_step(state, batch, None, grad_accum=2,
                           weight_fn=lambda b: jnp.sum(b["mask"]), **kw)
  np.testing.assert_allclose(two["params"]["w"], one["params"]["w"], atol=1e-6)
  np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
