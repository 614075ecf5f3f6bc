"""On-policy RL on the shared loop (align/rollout.py, ppo.py, grpo.py, rewards.py): rollouts
deterministic per seed, masked to the completion, without recompiling per step; PPO and GRPO
runs of a tiny model; group-normalised advantages; an update that improves its objective;
exact resume with an adaptive KL coefficient; a reward-model workdir as the reward."""

import itertools
import json
import os

import jax
import numpy as np
import optax
import pytest

import parallel
from align import arith, rl
from align.grpo import GRPOTask
from align.ppo import KL_LEDGER, PPOTask
from align.reward import RewardTask
from align.rewards import make_scorer, reward_fn
from align.rollout import Rollout, prompt_dataset, row_seeds
from conftest import build_once
from test_align_tasks import REPO, metrics, tiny
from train.loop import train
from train.optimizer import make_optimizer
from train.setup import plan_run
from train.task import batch_sharding, to_global


def rl_config(section, steps=3, **overrides):
  c = tiny(steps=steps, **overrides)
  c.seq_len, c.log_every, c.optimizer.warmup_steps = 128, 1, 0
  c.eval_batches = 2
  s = c.align[section]
  s.max_new_tokens, s.epochs = 6, 1
  return c


@pytest.fixture(scope="session")
def rm_workdir(tmp_path_factory):
  """A reward model trained for two steps: a tokenizer for the others and an rm: reward.
  Built once per test run (tests/test_judge.py and tests/test_pairs.py use it too)."""

  def build(path):
    workdir = os.path.join(path, "rm")
    config = tiny(steps=2)
    train(config, workdir, task=RewardTask(config, workdir))

  return os.path.join(build_once(tmp_path_factory, "rm_workdir", build), "rm")


def setup(task_cls, config, workdir):
  """(task, plan, train iterator, state, frozen), as the loop makes them."""
  plan = plan_run(config, workdir)
  task = task_cls(config, workdir)
  data = task.datasets(plan)
  tx, _ = make_optimizer(config.optimizer, config.steps)
  with parallel.axis_rules(plan.layout.rules), jax.set_mesh(plan.mesh):
    state, _, frozen, _ = task.init_state(plan, tx, plan.mesh, plan.layout)
  return task, plan, iter(data["train"]), state, frozen


def in_context(plan):
  import contextlib
  stack = contextlib.ExitStack()
  stack.enter_context(parallel.axis_rules(plan.layout.rules))
  stack.enter_context(jax.set_mesh(plan.mesh))
  return stack


def test_programmatic_rewards():
  assert reward_fn("letter:e")("", "eEx ") == pytest.approx(0.5)
  assert reward_fn("word:yes")("q", "Yes, yes and no") == pytest.approx(0.5)
  assert reward_fn("length:2:4")("", "abc") == 1.0
  assert reward_fn("length:2:4")("", "abcdef") == pytest.approx(1 - 2 / 3)
  assert reward_fn("length:2:4")("", "x" * 50) == 0.0
  for bad in ("nope", "letter:ab", "length:5:1", "word"):
    with pytest.raises(ValueError):
      reward_fn(bad)
  rollout = Rollout({}, ["p", "q"], ["eee", "xyz"], ["stop", "length"])
  np.testing.assert_allclose(make_scorer("letter:e")(rollout), [1.0, 0.0])


def test_prompt_rows_and_seeds_follow_the_global_row_whatever_the_process_count():
  """Process i's prompts are rows [i*b, (i+1)*b) of the one-process batch (validation padded
  alike), and their seeds those of their global rows: 2 processes sample what 1 does."""
  prompts = [np.arange(1, n + 1, dtype=np.int32) for n in range(1, 12)]
  for split in ("train", "validation"):
    def batches(index, count):
      ds = prompt_dataset(prompts, batch_size=4, max_prompt_len=16, split=split, seed=3,
                          process_index=index, process_count=count)
      return list(itertools.islice(iter(ds), 4))
    whole, parts = batches(0, 1), [batches(i, 2) for i in range(2)]
    # train endless; validation one pass, 11 prompts padded to 3 batches of 4
    assert len(whole) == len(parts[0]) == len(parts[1]) == (4 if split == "train" else 3)
    for j, batch in enumerate(whole):
      assert parts[0][j]["prompt_ids"].shape == (2, 16)
      for k, v in batch.items():
        np.testing.assert_array_equal(np.concatenate([parts[0][j][k], parts[1][j][k]]), v)
    if split == "validation":  # one pass in order, the last row an empty padding prompt
      assert whole[0]["prompt_len"].tolist() == [1, 2, 3, 4]
      assert whole[-1]["prompt_len"].tolist() == [9, 10, 11, 0]
  assert row_seeds(7, 2, 3, start=3) == row_seeds(7, 2, 6)[3:]
  with pytest.raises(ValueError, match="split"):
    prompt_dataset(prompts, batch_size=3, max_prompt_len=16, split="train", seed=3,
                   process_index=0, process_count=2)


def test_rollouts_are_deterministic_masked_and_reuse_compiled_code(rm_workdir, tmp_path):
  from infer import engine
  config = rl_config("ppo", **{"tokenizer.path": rm_workdir})
  config.align.ppo.temperature = 1.0
  task, plan, it, state, frozen = setup(PPOTask, config, str(tmp_path))
  prompts = next(it)
  with in_context(plan):
    seeds = row_seeds(config.seed, 5, config.batch_size)
    a = task.rollout(state["params"], frozen, prompts, seeds)
    b = task.rollout(state["params"], frozen, prompts, seeds)
    sizes = engine._prefill._cache_size(), engine._decode._cache_size()
    moved = jax.tree.map(lambda x: x * 1.01, state["params"])
    c = task.rollout(moved, frozen, prompts, row_seeds(config.seed, 6, config.batch_size))
    assert (engine._prefill._cache_size(), engine._decode._cache_size()) == sizes
  for k in a.batch:
    np.testing.assert_array_equal(a.batch[k], b.batch[k])
  assert a.completion_texts == b.completion_texts
  assert any((a.batch["inputs"] != c.batch["inputs"]).ravel())  # other seeds, other samples
  n = config.align.ppo.max_new_tokens
  for row in range(config.batch_size):
    p = int(prompts["prompt_len"][row])
    comp = int(a.batch["segment_ids"][row].sum()) + 1 - p  # a row holds p + comp - 1 inputs
    assert 1 <= comp <= n
    np.testing.assert_array_equal(a.batch["inputs"][row, :p], prompts["prompt_ids"][row, :p])
    want = np.zeros(config.seq_len, np.int32)
    want[p - 1:p - 1 + comp] = 1  # the targets that are completion tokens, EOS included
    np.testing.assert_array_equal(a.batch["loss_mask"][row], want)
    if a.finish_reasons[row] == "stop":
      assert a.batch["targets"][row, p + comp - 2] == plan.tokenizer.eos_id


def test_ppo_with_a_reward_model_on_the_loop(rm_workdir, tmp_path):
  from train.workdir import load_trained
  config = rl_config("ppo", **{"tokenizer.path": rm_workdir})
  config.align.ppo.reward = "rm:" + rm_workdir
  config.align.ppo.epochs, config.align.ppo.minibatches = 2, 2
  last = train(config, str(tmp_path), task=PPOTask(config, str(tmp_path)))
  want = {"loss", "grad_norm", "reward", "kl", "kl_coef", "clipfrac", "approx_kl", "value_loss",
          "policy_loss", "entropy", "vf_clipfrac", "response_length", "val_reward", "val_kl"}
  assert want <= set(last)
  assert all(np.isfinite(v) for v in last.values())
  assert metrics(str(tmp_path))[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # policy == ref
  model, _, step = load_trained(str(tmp_path))  # the value head does not stop it loading
  assert step == config.steps and not hasattr(model, "value_head")


def test_grpo_advantages_per_group_and_an_update_improves_the_objective(rm_workdir, tmp_path):
  from train.step import objective_step
  lines = tmp_path / "prompts.txt"
  lines.write_text("".join(f"Tell me about the number {i}.\n" for i in range(40)))
  config = rl_config("grpo", **{"tokenizer.path": rm_workdir, "data.path": str(lines),
                                "data.doc_separator": "\n", "data.val_fraction": 0.0})
  g = config.align.grpo
  g.prompts, g.reward, g.group_size, g.beta = "text", "letter:e", 2, 0.1
  g.max_new_tokens, config.batch_size = 12, 8
  task, plan, it, state, frozen = setup(GRPOTask, config, str(tmp_path / "w"))
  prompts = next(it)
  assert prompts["prompt_ids"].shape[0] == config.batch_size // g.group_size
  with in_context(plan):
    batch = task.prepare(state, frozen, prompts, 0)
    rows = batch["inputs"]
    for b in range(0, config.batch_size, 2):  # a group: one prompt, its own samples
      p = int(prompts["prompt_len"][b // 2])
      np.testing.assert_array_equal(rows[b, :p], rows[b + 1, :p])
    want = rl.grpo_advantages(batch["scores"].reshape(-1, 2)).reshape(-1)
    np.testing.assert_allclose(batch["advantages"], want, rtol=1e-6)
    assert np.abs(batch["advantages"]).max() > 0  # some group's samples score differently
    np.testing.assert_allclose(batch["advantages"].reshape(-1, 2).sum(1), 0.0, atol=1e-5)
    # One small step lowers the surrogate loss on its batch (first order: a descent step).
    tx = optax.sgd(0.01)
    state = dict(state, opt_state=tx.init(state["params"]))
    gbatch = to_global(batch, batch_sharding(plan.mesh))
    before, _ = task.loss(state["params"], frozen, gbatch)
    new, m = objective_step(state, gbatch, frozen, loss_fn=task.loss, tx=tx,
                            schedule=lambda step: 0.01)
    after, _ = task.loss(new["params"], frozen, gbatch)
  assert float(after) < float(before) and m["clipfrac"] == 0.0


def test_ppo_resumes_exactly_with_an_adaptive_kl(rm_workdir, tmp_path):
  def config():
    c = rl_config("ppo", steps=4, **{"tokenizer.path": rm_workdir})
    c.checkpoint_every, c.eval_every = 2, 100
    p = c.align.ppo
    p.epochs, p.minibatches = 2, 2
    p.kl_target, p.kl_horizon, p.kl_coef = 0.01, 10.0, 0.2
    return c
  whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
  train(config(), whole, task=PPOTask(config(), whole))
  train(config(), part, stop_at=2, task=PPOTask(config(), part))
  train(config(), part, task=PPOTask(config(), part))
  rows_w, rows_p = metrics(whole), metrics(part)
  for key in ("loss", "kl_coef", "reward", "value_loss"):
    assert rows_p[-1][key] == pytest.approx(rows_w[-1][key], rel=1e-6), key
  assert rows_w[-1]["kl_coef"] != rows_w[0]["kl_coef"]  # the controller moved it
  with open(os.path.join(part, KL_LEDGER)) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]


def test_grpo_scores_the_arithmetic_task_exactly(rm_workdir, tmp_path):
  """`reward=arith` on data/arith: the loop's decoded chat prompts parse, and each score is
  1 exactly where the completion's final answer is the record's answer."""
  data = os.path.join(REPO, "data", "arith")
  config = rl_config("grpo", **{"tokenizer.path": rm_workdir,
                                "data.path": os.path.join(data, "train.jsonl"),
                                "data.validation_path": os.path.join(data, "heldout.jsonl")})
  g = config.align.grpo
  g.reward, g.group_size, g.max_new_tokens, config.batch_size = "arith", 2, 8, 8
  with open(os.path.join(data, "train.jsonl")) as f:
    answers = {r["prompt"].split("\n")[0]: r["answer"] for r in map(json.loads, f)}
  task, plan, it, state, frozen = setup(GRPOTask, config, str(tmp_path))
  with in_context(plan):
    rollout = task.rollout(state["params"], frozen, next(it), row_seeds(0, 0, 8), repeat=2)
    scores = task.scorer(rollout)
  truths = [[a for problem, a in answers.items() if problem in p] for p in rollout.prompt_texts]
  assert all(len(t) == 1 for t in truths), truths
  np.testing.assert_array_equal(scores, [float(arith.final_answer(c) == t)
                                         for c, [t] in zip(rollout.completion_texts, truths)])
  # the tiny model's answers are noise: right and wrong ones written in score 1 and 0
  written = Rollout({}, rollout.prompt_texts[:2], [f"Answer: {truths[0][0]}",
                                                   f"Answer: {truths[1][0] + 1}"], ["stop"] * 2)
  np.testing.assert_array_equal(task.scorer(written), [1.0, 0.0])
