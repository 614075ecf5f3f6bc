"""Shared fixtures: a tiny training config over a slice of Tiny Shakespeare."""

import os

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


@pytest.fixture
def shakespeare_slice(tmp_path):
  """The first ~40 KB of Tiny Shakespeare, as its own file."""
  with open(SHAKESPEARE) as f:
    text = f.read()[:40_000]
  path = tmp_path / "shakespeare_slice.txt"
  path.write_text(text)
  return str(path)
