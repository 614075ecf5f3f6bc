"""The `meshlm` command line: an end-to-end smoke run, and clear errors for bad input."""

import os
import subprocess
import sys

import pytest

from conftest import REPO
from cli.main import dispatch as main

QUICKSTART = os.path.join(REPO, "experiments", "quickstart.py")
TINY = ["--config.steps=4", "--config.batch_size=4", "--config.seq_len=32",
        "--config.log_every=2", "--config.eval_every=4", "--config.eval_batches=1",
        "--config.checkpoint_every=2", "--config.model.vocab_size=320",
        "--config.tokenizer.train_vocab_size=320", "--config.model.d_model=32",
        "--config.model.num_layers=1", "--config.model.mlp_dim=64",
        "--config.peak_flops_per_device=1e11", "--config.sample.max_new_tokens=8"]


def _meshlm(*args, timeout=300):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO, env=env)


def test_train_then_generate_end_to_end(tmp_path):
  workdir = str(tmp_path / "run")
  out = _meshlm("train", "--config", QUICKSTART, "--workdir", workdir, *TINY)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "--- sample ---" in out.stdout
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "4"))
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert len(f.readlines()) == 2
  out = _meshlm("generate", "--model", workdir, "--prompt", "ROMEO:", "--max_new_tokens", "5")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip()


def _fails(tmp_path, *args, match):
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:
    main(list(args) if args[0] == "generate" else
         ["train", "--config", QUICKSTART, "--workdir", str(workdir), *args])
  assert match in str(info.value), str(info.value)
  assert not workdir.exists(), "a failed start must not leave a workdir behind"


def test_unknown_config_key(tmp_path):
  _fails(tmp_path, "--config.model.dmodel=64", match="dmodel")


def test_unknown_top_level_config_key(tmp_path):
  _fails(tmp_path, "--config.stepz=5", match="stepz")


def test_num_heads_not_dividing_d_model(tmp_path):
  _fails(tmp_path, "--config.model.num_heads=3", match="num_heads=3 does not divide model.d_model=128")


def test_num_heads_not_multiple_of_kv_heads(tmp_path):
  _fails(tmp_path, "--config.model.num_kv_heads=3",
         match="num_heads=4 is not a multiple of model.num_kv_heads=3")


def test_missing_data_file(tmp_path):
  _fails(tmp_path, "--config.data.path=/no/such/corpus.txt", match="/no/such/corpus.txt")


def test_missing_init_checkpoint(tmp_path):
  _fails(tmp_path, "--config.init_from=/no/such/checkpoint", match="/no/such/checkpoint does not exist")


def test_missing_config_file(tmp_path):
  with pytest.raises(SystemExit, match="nope.py"):
    main(["train", "--config", str(tmp_path / "nope.py"), "--workdir", str(tmp_path / "run")])
  assert not (tmp_path / "run").exists()


def test_generate_from_missing_path(tmp_path):
  _fails(tmp_path, "generate", "--model", "/no/such/model", "--prompt", "hi",
         match="/no/such/model does not exist")


def test_generate_from_directory_that_is_not_a_model(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(SystemExit, match="config.json"):
    main(["generate", "--model", str(tmp_path / "empty"), "--prompt", "hi"])


def test_config_argument_selects_the_architecture(tmp_path):
  # "file.py:arg" reaches get_config(arg): the encoder-decoder then refuses a plain LM task.
  config = os.path.join(REPO, "experiments", "arch_compare.py") + ":encoder_decoder"
  run = subprocess.run([sys.executable, "-m", "cli.main", "train", "--config", config,
                        "--workdir", str(tmp_path / "run"), "--config.data.task=lm"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
  assert run.returncode != 0
  assert "model.arch='encoder_decoder' trains with data.task='seq2seq'" in run.stderr
