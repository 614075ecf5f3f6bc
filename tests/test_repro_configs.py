"""The reproduction configs (experiments/repro/): every variant loads and its task accepts it,
the paper-scale layouts fit `meshlm plan`'s 80 GiB budget, the hh-rlhf split holds what the
docs say, and each method runs two steps of its :smollm2 variant shrunk to a tiny model."""

import importlib
import json
import os

import deps
import jax
import numpy as np
import pytest

from align import datasets as DS
from align.data import DataReport
from align.dpo import DPOTask
from align.grpo import GRPOTask
from align.ppo import PPOTask
from align.reward import RewardTask
from benchmarks import frontier, repro_report, rm_winrate
from cli.train import make_task
from experiments.repro import common
from train.checkpoint import restore_params
from train.data import is_validation, resolve_paths
from train.loop import train
from train.plan.report import plan
from train.state import split_abstract_model
from train.workdir import MERGED, load_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-slice.jsonl")
TASKS = {"rm": RewardTask, "dpo": DPOTask, "ppo": PPOTask, "grpo": GRPOTask}
VARIANTS = [(m, v) for m in TASKS for v in common.VARIANTS] + [("ppo", "smollm2_rm")]


def get_config(method: str, variant: str):
  return importlib.import_module(f"experiments.repro.{method}").get_config(variant)


@pytest.mark.parametrize("method,variant", VARIANTS)
def test_every_variant_loads_and_its_task_accepts_it(method, variant, tmp_path):
  c = get_config(method, variant)
  assert c.init_from == (deps.smollm() if variant != "paper" else "")
  assert (c.mesh.fsdp, c.model.dtype) == ((-1, "bfloat16") if variant == "paper" else
                                          (1, "float32"))
  make_task(method, c, str(tmp_path / "w"))  # the align.* checks; writes nothing
  assert not os.path.exists(tmp_path / "w")


def test_an_unknown_variant_is_refused():
  with pytest.raises(ValueError, match="choose one of"):
    get_config("rm", "smollm3")


# (method, devices, rows to plan): a pair step forwards 2 x batch_size rows.
PODS = [("rm", 16, 128), ("dpo", 8, 128), ("ppo", 64, 512), ("grpo", 64, 1024)]


@pytest.mark.parametrize("method,devices,rows", PODS)
def test_paper_scale_layouts_fit_80_gib(method, devices, rows):
  c = get_config(method, "paper")
  c.batch_size = rows
  out = plan(c, devices, budget_gb=80.0, do_suggest=False)
  assert out["estimate"]["mesh"]["fsdp"] == devices and out["estimate"]["unused_axes"] == []
  assert out["verdict"]["fits"], out["verdict"]


def test_the_hh_split_is_decontaminated_with_500_held_out_pairs_that_fit():
  """HH_PAIRS is the two decontaminated assets; 999 of their 4,898 records are held out (by
  first user turn; the 3 openings both files share land on one side each), the train split
  passes the decontamination check, and 584 held-out pairs fit the :smollm2 seq_len."""
  files = [os.path.relpath(f, REPO) for f in resolve_paths(common.HH_PAIRS)]
  assert files == [f"data/hh-rlhf/helpful-{n}-test-decontam/v1/data.jsonl"
                   for n in ("base", "rejection-sampled")]
  keys = []
  for f in files:
    with open(os.path.join(REPO, f), encoding="utf-8") as lines:
      keys.append([DS.record_key(json.loads(line)) for line in lines])
  held = [sum(is_validation(k, common.HH_VAL_FRACTION) for k in ks) for ks in keys]
  assert [len(k) for k in keys] == [2210, 2688] and sum(held) == 999
  assert len(set(keys[0]) & set(keys[1])) == 3
  cfg = {"path": common.HH_PAIRS, "val_fraction": common.HH_VAL_FRACTION}
  assert len(list(DS.split_items(cfg, "train", DataReport()))) == 3899  # decontam passes
  from gguf import GGUFReader

  from models.gguf_tokenizer import tokenizer_from_gguf
  tok = tokenizer_from_gguf(GGUFReader(deps.smollm()), deps.smollm())
  for seq_len in {get_config(m, "smollm2").seq_len for m in ("rm", "dpo")}:
    pairs, report = DS.load_pair_split({**cfg, "max_len": seq_len}, tok, "validation")
    assert len(pairs) == report.kept == 584 and report.total == 999


# --- two steps of each method, tiny ---


def tiny(c, tmp_path, steps: int = 2):
  """`c` at a tiny size from scratch: a 2-layer model, a 512-token BPE trained on its data."""
  c.init_from = ""
  c.steps, c.batch_size = steps, 4
  c.log_every = c.eval_every = c.checkpoint_every = steps
  c.eval_batches = 1
  c.model.vocab_size = c.tokenizer.train_vocab_size = 512
  c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 32, 2, 2, 1
  c.model.mlp_dim = 64
  c.peak_flops_per_device = 1e11  # no CPU peak measurement
  c.async_checkpoints = False
  c.seq_len = 256 if c.data.path == common.HH_PAIRS else 128  # hh-rlhf rows are long
  if c.data.path == common.HH_PAIRS:
    c.data.path = SLICE
  else:
    # small slices of the config's own arithmetic prompts, scored by its `arith` reward
    assert (c.data.path, c.data.validation_path) == (common.ARITH_TRAIN, common.ARITH_HELDOUT)
    for key, src, rows in (("path", common.ARITH_TRAIN, 24),
                           ("validation_path", common.ARITH_HELDOUT, 8)):
      with open(src) as f:
        head = [next(f) for _ in range(rows)]
      (tmp_path / f"{key}.jsonl").write_text("".join(head))
      c.data[key] = str(tmp_path / f"{key}.jsonl")
    assert common.ARITH_REWARD in (c.align.ppo.reward, c.align.grpo.reward)
  for section in ("ppo", "grpo"):
    c.align[section].max_new_tokens = 8
  c.align.ppo.minibatches = 2
  c.align.grpo.group_size = 2
  return c


def run(method: str, variant: str, tmp_path, **overrides) -> dict:
  c = tiny(get_config(method, variant), tmp_path)
  c.update_from_flattened_dict(overrides)
  workdir = str(tmp_path / method)
  last = train(c, workdir, task=TASKS[method](c, workdir))
  assert all(np.isfinite(v) for v in last.values()), last
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [2]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  return last


@pytest.fixture(scope="module")
def rm_workdir(tmp_path_factory):
  """rm.py:smollm2 (full fine-tuning) for two steps: a reward PPO can score with (rm:DIR)."""
  tmp = tmp_path_factory.mktemp("repro_rm")
  last = run("rm", "smollm2", tmp)
  assert 0 <= last["val_accuracy_ci_low"] <= last["val_accuracy"] <= last["val_accuracy_ci_high"]
  return str(tmp / "rm")


def test_rm_two_steps(rm_workdir):
  with open(os.path.join(rm_workdir, "data_report_validation.json")) as f:
    assert json.load(f)["kept"] > 0


def test_dpo_two_steps(tmp_path):
  last = run("dpo", "smollm2", tmp_path)
  assert {"rewards/margins", "val_rewards/accuracies"} <= set(last)
  assert last["val_rewards/accuracies_ci_low"] <= last["val_rewards/accuracies"] <= \
      last["val_rewards/accuracies_ci_high"]


@pytest.mark.parametrize("method", ["ppo", "grpo"])
def test_on_policy_two_steps(method, tmp_path):
  last = run(method, "smollm2", tmp_path)
  assert {"reward", "clipfrac", "val_reward"} <= set(last)


@pytest.fixture(scope="module")
def dpo_base(rm_workdir, tmp_path_factory):
  """dpo.py:smollm2 for two steps from scratch with the reward model's tokenizer: a starting
  model for the runs the benchmarks below compare."""
  tmp = tmp_path_factory.mktemp("repro_base")
  run("dpo", "smollm2", tmp, seed=0, **{"tokenizer.path": rm_workdir})
  return str(tmp / "dpo")


@pytest.fixture(scope="module")
def ppo_rm_workdir(rm_workdir, dpo_base, tmp_path_factory):
  """ppo.py:smollm2_rm (LoRA) from `dpo_base` for two steps, scored by rm:WORKDIR, a
  checkpoint each step."""
  tmp = tmp_path_factory.mktemp("repro_ppo_rm")
  run("ppo", "smollm2_rm", tmp, init_from=dpo_base, checkpoint_every=1,
      **{"align.ppo.reward": "rm:" + rm_workdir})
  return tmp / "ppo"


def test_ppo_scored_by_the_reward_model(ppo_rm_workdir):
  """ppo.py:smollm2_rm: hh-rlhf prompts scored by rm:WORKDIR (the policy shares its tokenizer);
  its KL coefficient adapts each step: a KL far below the target lowers it by 0.2·4/10,000
  (err clipped at -0.2, 4 rollouts a step, horizon 10,000)."""
  with open(ppo_rm_workdir / "kl_controller.jsonl") as f:
    ledger = [json.loads(line) for line in f]
  assert [e["step"] for e in ledger] == [1, 2]
  np.testing.assert_allclose([e["kl_coef"] for e in ledger],
                             [0.02 * (1 - 0.2 * 4 / 1e4) ** n for n in (1, 2)], rtol=1e-6)


def test_rm_winrate_judges_a_policy_against_its_start(rm_workdir, dpo_base, tmp_path, capsys):
  """benchmarks/rm_winrate: two tiny DPO policies that share the judge's tokenizer, one as
  the starting model; each prompt's verdict is read from the judge's two scores."""
  run("dpo", "smollm2", tmp_path, seed=1, **{"tokenizer.path": rm_workdir})
  argv = ["--policy", str(tmp_path / "dpo"), "--base", dpo_base,
          "--judge", rm_workdir, "--data", SLICE, "--val-fraction", "0.5", "--limit", "6",
          "--max-new-tokens", "4", "--max-prompt-tokens", "200", "--batch-size", "4"]
  capsys.readouterr()  # the training runs' output
  assert rm_winrate.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["n"] == 6 == out["wins"] + out["ties"] + out["losses"] == len(out["per_prompt"])
  for row in out["per_prompt"]:
    assert row["win"] == (0.5 if row["same"] else float(row["policy"] > row["base"])), row
  assert out["win_rate"] == sum(r["win"] for r in out["per_prompt"]) / 6
  low, high = out["bootstrap95"]
  assert low <= out["win_rate"] <= high
  with pytest.raises(SystemExit, match="does not exist"):
    rm_winrate.main(argv[:1] + [str(tmp_path / "nowhere")] + argv[2:])


def test_repro_report_records_a_finished_run(rm_workdir, tmp_path, capsys):
  """benchmarks/repro_report: the committed JSON of a run holds its held-out accuracy with
  the interval, its curve and wall time; a config that does not match the run is refused."""
  argv = ["--config", "experiments/repro/rm.py:smollm2", "--workdir", rm_workdir,
          "--set", "steps=2", "--set", "batch_size=4", "--set", "seq_len=256",
          "--out", str(tmp_path / "rm.json"), "--plot", str(tmp_path / "rm.png")]
  assert repro_report.main(argv) == 0
  with open(tmp_path / "rm.json") as f:
    out = json.load(f)
  with open(os.path.join(rm_workdir, "metrics.jsonl")) as f:
    last = [json.loads(line) for line in f][-1]
  assert out["held_out"]["val_accuracy"] == last["val_accuracy"]
  assert out["held_out"]["ci95"] == [last["val_accuracy_ci_low"], last["val_accuracy_ci_high"]]
  assert out["token_slots"] == 2 * 4 * 2 * 256 and out["wall_seconds"] > 0
  assert out["command"].endswith("--config.steps=2 --config.batch_size=4 --config.seq_len=256")
  assert os.path.getsize(tmp_path / "rm.png") > 0
  with pytest.raises(SystemExit, match="not at its config's 276"):
    repro_report.main(argv[:4] + argv[10:])


def test_the_report_plot_smooths_over_the_logs_before_each():
  assert repro_report.moving_average([1.0, 2.0, 3.0, 6.0], 2) == [1.0, 1.5, 2.5, 4.5]
  assert repro_report.moving_average([4.0, 0.0], 8) == [4.0, 2.0]


def test_frontier_measures_every_checkpoint_of_a_full_and_a_lora_run(
    rm_workdir, dpo_base, ppo_rm_workdir, tmp_path, capsys):
  """benchmarks/frontier: DPO (full fine-tuning) and PPO (LoRA) from one tiny base, judged by
  the tiny reward model. pi_ref's KL is exactly 0; each kept checkpoint is a point; the LoRA
  run's adapters merged here match the merged model the run wrote."""
  run("dpo", "smollm2", tmp_path, init_from=dpo_base, checkpoint_every=1)
  argv = ["--dpo", str(tmp_path / "dpo"), "--ppo", str(ppo_rm_workdir), "--judge", rm_workdir,
          "--base", dpo_base, "--data", SLICE, "--val-fraction", "0.5", "--limit", "6",
          "--max-new-tokens", "4", "--max-prompt-tokens", "200", "--batch-size", "4",
          "--plot", str(tmp_path / "frontier.png")]
  capsys.readouterr()
  assert frontier.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["ref"]["kl"] == 0.0 and out["prompts"] == 6
  assert [[p["step"] for p in r["points"]] for r in out["runs"]] == [[0, 1, 2], [0, 1, 2]]
  dpo, ppo = out["runs"]
  assert dpo["lora_rank"] == 0 and dpo["merged_max_abs_diff"] is None
  assert ppo["lora_rank"] == 16 and ppo["merged_max_abs_diff"] <= 1e-5
  assert all(np.isfinite([p["reward"], p["kl"]]).all() for r in out["runs"] for p in r["points"])
  for p in dpo["points"][1:] + ppo["points"][1:]:
    g = p["gain"]
    assert g["mean"] == pytest.approx(p["reward"] - out["ref"]["reward"], abs=1e-6)
    assert g["bootstrap95"][0] <= g["mean"] <= g["bootstrap95"][1]
  assert out["frontier"]["dominates"] in ("dpo", "ppo", "tie", "mixed")
  assert os.path.getsize(tmp_path / "frontier.png") > 0
  with pytest.raises(SystemExit, match="does not exist"):
    frontier.main(argv[:1] + [str(tmp_path / "nowhere")] + argv[2:])


def test_frontier_refuses_a_merge_that_is_not_the_runs(ppo_rm_workdir):
  """merged_difference compares every array of the run's merged model: a tree with one array
  fewer, or one value off, is refused rather than compared on a prefix."""
  merged = os.path.join(ppo_rm_workdir, MERGED)
  saved, step = restore_params(merged, split_abstract_model(load_model_config(merged))[1])
  leaves = jax.tree.leaves(saved)
  assert frontier.merged_difference(str(ppo_rm_workdir), saved, step) == 0.0
  assert frontier.merged_difference(str(ppo_rm_workdir), saved, step + 1) is None
  with pytest.raises(SystemExit, match="arrays"):
    frontier.merged_difference(str(ppo_rm_workdir), leaves[:-1], step)
  with pytest.raises(SystemExit, match="differ from"):
    frontier.merged_difference(str(ppo_rm_workdir), [x + 1e-3 for x in leaves], step)
