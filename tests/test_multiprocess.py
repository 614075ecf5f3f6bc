"""Multi-process training on 127.0.0.1 with gloo, and launch-environment detection."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, device_env, finish_all
from parallel.distributed import detect

# Sleeps, timeouts and killed processes: run alone, after the parallel part (README).
pytestmark = pytest.mark.serial

QUICKSTART = os.path.join(REPO, "experiments", "quickstart.py")
TINY = ["--config.steps=6", "--config.batch_size=8", "--config.seq_len=32",
        "--config.log_every=1", "--config.eval_every=6", "--config.eval_batches=1",
        "--config.checkpoint_every=3", "--config.model.vocab_size=320",
        "--config.tokenizer.train_vocab_size=320", "--config.model.d_model=32",
        "--config.model.num_layers=2", "--config.model.mlp_dim=64",
        "--config.peak_flops_per_device=1e11", "--config.sample.max_new_tokens=0",
        "--config.data.num_shards=2", "--config.sharding=fsdp", "--config.mesh.data=2",
        "--config.mesh.fsdp=-1"]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, devices, extra=()):
  env = device_env(devices)
  cmd = [sys.executable, "-m", "cli.main", "train", "--config", QUICKSTART,
         "--workdir", workdir, *TINY, *extra]
  return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f)]


def test_two_processes_match_one_process(tmp_path):
  """2 processes x 4 CPU devices (gloo) train to the losses of 1 process x 8 devices."""
  single = str(tmp_path / "single")
  finish_all([_launch(single, 8)])

  multi = str(tmp_path / "multi")
  port = _free_port()
  outs = finish_all([_launch(multi, 4, ["--coordinator_address", f"127.0.0.1:{port}",
                                        "--num_processes", "2", "--process_id", str(i)])
                     for i in range(2)])
  assert "8 device(s) in 2 process(es)" in outs[0], outs[0][-2000:]
  assert "meshlm:" not in outs[1]  # only process 0 reports
  a, b = _losses(single), _losses(multi)
  assert len(a) == len(b) == 6
  np.testing.assert_allclose(b, a, rtol=1e-5)


def test_detect_explicit_and_env():
  assert detect({}) is None
  assert detect({}, "127.0.0.1:1234", 2, 1) == dict(
      coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1)
  env = {"MESHLM_COORDINATOR_ADDRESS": "h:1", "MESHLM_NUM_PROCESSES": "4",
         "MESHLM_PROCESS_ID": "3"}
  assert detect(env) == dict(coordinator_address="h:1", num_processes=4, process_id=3)


def test_detect_jobset_slurm_and_tpu():
  jobset = {"JOBSET_NAME": "run", "REPLICATED_JOB_NAME": "workers", "JOB_COMPLETION_INDEX": "5",
            "MESHLM_NUM_PROCESSES": "16"}
  assert detect(jobset) == dict(coordinator_address="run-workers-0-0.run:8476",
                                num_processes=16, process_id=5)
  assert detect({"SLURM_NTASKS": "8", "SLURM_PROCID": "2"}) == {}
  assert detect({"SLURM_NTASKS": "1"}) is None
  assert detect({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == {}


def test_detect_errors_name_the_problem():
  with pytest.raises(ValueError, match="missing \\['num_processes'\\]"):
    detect({}, "127.0.0.1:1", None, 0)
  with pytest.raises(ValueError, match="process_id=2 not in \\[0, num_processes=2\\)"):
    detect({}, "127.0.0.1:1", 2, 2)
  with pytest.raises(ValueError, match="set MESHLM_NUM_PROCESSES"):
    detect({"JOBSET_NAME": "run", "JOB_COMPLETION_INDEX": "0"})
