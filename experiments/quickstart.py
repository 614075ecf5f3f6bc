"""Quickstart: a small Llama-style model on Tiny Shakespeare, a few minutes on one CPU.

  meshlm train --config experiments/quickstart.py --workdir runs/quickstart
  meshlm generate --model runs/quickstart --prompt "ROMEO:"
"""

from train.data_root import data_path
from train.defaults import base_config


def get_config():
  c = base_config()
  c.steps = 600
  c.batch_size = 16
  c.seq_len = 128
  c.log_every = 25
  c.eval_every = 100
  c.eval_batches = 8
  c.checkpoint_every = 200

  c.model.vocab_size = 1024
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.mlp_dim = 352
  c.model.max_seq_len = 512
  c.model.tie_embeddings = True

  c.tokenizer.train_vocab_size = 1024
  c.data.path = data_path("tinyshakespeare", "input.txt")

  c.optimizer.lr = 3e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.0

  c.sample.prompt = "ROMEO:"
  c.sample.max_new_tokens = 96
  return c
