"""PPO and GRPO on many processes (align/onpolicy.py): 2 processes x 1 CPU device (gloo on
127.0.0.1) train to the per-step metrics of 1 process x 2 devices. Same mesh shape, same
global batches and sampling seeds by global row, so each process sampling only its share of
the prompts changes nothing: GRPO's groups stay whole on one process, PPO's advantage
whitening and adaptive KL use the global batch, evaluation sums over both processes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, device_env, finish_all
from serve_util import free_port

# Several processes started at once, gloo and timeouts: run alone, as tests/test_multiprocess.
pytestmark = pytest.mark.serial

CONFIG = os.path.join(REPO, "experiments", "hh_tiny.py")
SETTINGS = {"steps": 3, "batch_size": 8, "seq_len": 64, "log_every": 1, "eval_every": 3,
            "eval_batches": 2, "checkpoint_every": 3, "peak_flops_per_device": 1e11,
            "optimizer.warmup_steps": 0, "data.val_fraction": 0.2,
            "tokenizer.train_vocab_size": 320, "model.vocab_size": 320, "model.d_model": 32,
            "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
            "model.mlp_dim": 64}
TINY = [f"--config.{k}={v}" for k, v in SETTINGS.items()]
CASES = {
    # two updates a step over the global rows; a reference (beta > 0); 2 of 4 groups each
    "grpo": ["--config.align.grpo.group_size=2", "--config.align.grpo.beta=0.1",
             "--config.align.grpo.minibatches=2"],
    # params split over both processes (fsdp=2): each moves them onto its own device to
    # sample; whitened advantages and an adaptive KL coefficient
    "ppo": ["--config.sharding=fsdp", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
            "--config.align.ppo.epochs=2", "--config.align.ppo.minibatches=2",
            "--config.align.ppo.kl_target=0.01", "--config.align.ppo.kl_horizon=10.0",
            "--config.align.ppo.kl_coef=0.2"],
}
TIMING = {"tokens_per_s", "mfu"}


def _launch(command, workdir, devices, extra):
  cmd = [sys.executable, "-m", "cli.main", command, "--config", CONFIG, "--workdir", workdir,
         *TINY, *CASES[command], *extra]
  return subprocess.Popen(cmd, env=device_env(devices), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("command", sorted(CASES))
def test_two_processes_match_one_process(tmp_path, command):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"Tell me about the number {i}.\n\n" for i in range(40)))
  data = [f"--config.data.path={prompts}", f"--config.align.{command}.prompts=text",
          f"--config.align.{command}.max_new_tokens=8"]
  single, multi, port = str(tmp_path / "single"), str(tmp_path / "multi"), free_port()
  # All three at once (each trains the same BPE tokenizer from the prompts): on two cores
  # one process's compiling overlaps the others' waiting.
  outs = finish_all([_launch(command, single, 2, data)] + [
      _launch(command, multi, 1, data + ["--coordinator_address", f"127.0.0.1:{port}",
                                         "--num_processes", "2", "--process_id", str(i)])
      for i in range(2)])
  assert "2 device(s) in 2 process(es)" in outs[1], outs[1][-2000:]
  one, two = _metrics(single), _metrics(multi)
  assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
  assert one[-1]["val_count"] > 0  # evaluation ran, over both processes' prompts
  for a, b in zip(one, two):
    assert set(a) == set(b)
    keys = sorted(set(a) - TIMING)
    # Observed bit-identical; the tolerance allows only for a reduction order XLA may pick.
    np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=1e-5,
                               atol=1e-7, err_msg=f"step {a['step']}: {keys}")
