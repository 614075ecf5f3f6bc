"""benchmarks/dpo_vs_ppo.py: its configs, prompts, frontier and compute-to-reward arithmetic
on made-up points, and the whole pipeline at --quick sizes (about a minute on 2 CPU cores)."""

import json

import numpy as np
import pytest

from benchmarks import dpo_vs_ppo as bench
from benchmarks import dpo_vs_ppo_analysis as analysis
from experiments import dpo_vs_ppo as exp


def test_configs():
  for kind in exp.KINDS:
    c = exp.get_config(kind)
    assert c.seq_len > exp.MAX_NEW_TOKENS
  ppo = exp.get_config("ppo").align.ppo
  assert (ppo.reward, ppo.prompts, ppo.temperature) == (exp.REWARD, "text", 1.0)
  assert exp.get_config("dpo").align.dpo.reference == "cached"
  with pytest.raises(ValueError):
    exp.get_config("sft")


def test_prompts_are_disjoint_and_short():
  s = bench.sweep(quick=True)
  train, held_out = bench.make_prompts(exp.SHAKESPEARE, s)
  assert (len(train), len(held_out)) == (s["train_prompts"], s["eval_prompts"])
  assert not set(train) & set(held_out)
  assert all(len(p.split()) == s["prompt_words"] for p in train + held_out)
  assert bench.make_prompts(exp.SHAKESPEARE, s) == (train, held_out)  # deterministic


def test_row_example_round_trips_a_rollout_row():
  from align.rollout import completion_batch
  batch = completion_batch([[5, 6, 7], [8]], [[9, 10, 2], [11]], seq_len=8)
  ids, mask = bench.row_example(batch, 0)
  np.testing.assert_array_equal(ids, [5, 6, 7, 9, 10, 2])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])
  ids, mask = bench.row_example(batch, 1)
  np.testing.assert_array_equal(ids, [8, 11])
  np.testing.assert_array_equal(mask, [0, 1])


def test_pareto_and_frontier():
  front = analysis.pareto([(0.0, 0.1), (1.0, 0.3), (2.0, 0.2), (0.5, 0.05), (3.0, 0.4)])
  assert front == [(0.0, 0.1), (1.0, 0.3), (3.0, 0.4)]
  assert analysis.frontier_at(front, 0.5) == pytest.approx(0.2)
  assert analysis.frontier_at(front, 10.0) == pytest.approx(0.4)  # flat past the last point


def _run(method, coef, rewards, kls, flops):
  return {"method": method, "coef": coef, "points": [
      {"step": i, "reward": r, "reward_se": 0.001, "kl": k, "flops": f, "wall_s": f / 10}
      for i, (r, k, f) in enumerate(zip(rewards, kls, flops))]}


def test_to_reward_interpolates_between_checkpoints():
  run = _run("ppo", 0.1, [0.1, 0.2, 0.4], [0, 1, 2], [0.0, 10.0, 20.0])
  assert analysis.to_reward([run], 0.3, "flops") == pytest.approx(15.0)
  assert analysis.to_reward([run], 0.5, "flops") is None
  faster = _run("ppo", 0.2, [0.1, 0.4], [0, 1], [0.0, 12.0])
  assert analysis.to_reward([run, faster], 0.4, "flops") == pytest.approx(12.0)


def test_analyse_names_the_dominating_frontier_and_the_compute_ratio():
  ref = {"reward": 0.1, "reward_se": 0.001, "kl": 0.0}
  dpo = _run("dpo", 0.1, [0.1, 0.3, 0.5], [0.0, 1.0, 2.0], [1.0, 2.0, 3.0])
  ppo = _run("ppo", 0.01, [0.1, 0.2, 0.5], [0.0, 1.0, 3.0], [0.0, 4.0, 9.0])
  out = analysis.analyse([dpo, ppo], ref)
  assert out["frontier"]["dominates"] == "dpo"
  half, best = out["compute_to_reward"]
  assert half["reward"] == pytest.approx(0.3) and best["reward"] == pytest.approx(0.5)
  assert half["dpo_flops"] == pytest.approx(2.0)
  assert half["ppo_flops"] == pytest.approx(4.0 + 5.0 / 3)  # 0.2 at 4, 0.5 at 9
  assert half["ppo_over_dpo_flops"] == pytest.approx((4.0 + 5.0 / 3) / 2.0)
  out = analysis.analyse([_run("dpo", 1, [0.1, 0.1], [0, 1], [0, 1]), ppo], ref)
  assert out["compute_to_reward"][0]["ppo_over_dpo_flops"] is None  # no gain for DPO


def test_quick_pipeline(tmp_path, capsys):
  plot = tmp_path / "plot.png"
  bench.main(["--quick", "--json", "--workdir", str(tmp_path / "w"), "--plot", str(plot)])
  doc = json.loads(capsys.readouterr().out)
  s = bench.sweep(quick=True)
  assert [(r["method"], r["coef"]) for r in doc["runs"]] == (
      [("dpo", b) for b in s["dpo_betas"]] + [("ppo", k) for k in s["ppo_kl_coefs"]])
  for r in doc["runs"]:
    steps = [p["step"] for p in r["points"]]
    assert steps == [0] + list(range(2, 5, 2))
    flops = [p["flops"] for p in r["points"]]
    assert flops == sorted(flops) and flops[-1] > 0
    assert all(np.isfinite(p["reward"]) and np.isfinite(p["kl"]) for p in r["points"])
  assert doc["runs"][0]["points"][0]["flops"] == doc["dpo_data"]["data_flops"] > 0
  assert doc["dpo_data"]["pairs"] + doc["dpo_data"]["ties_dropped"] == s["train_prompts"]
  assert doc["ref"]["kl"] == pytest.approx(0.0, abs=1e-5)  # pi_ref against itself
  assert doc["frontier"]["dominates"] in ("dpo", "ppo", "tie", "mixed")
  assert "| method |" in doc["table_md"]
  if doc.get("plot"):
    assert plot.stat().st_size > 0
