"""A small BERT-style encoder trained by masked-LM on Tiny Shakespeare (data.task="mlm").

Post-LayerNorm blocks, erf-GELU MLP with biases, learned positions, tied
embeddings: the layout of all-MiniLM-L6-v2, at quickstart size. The tokenizer is
a byte-level BPE of 1,024 tokens; model.vocab_size leaves one id past it for
the mask token (train/mlm_data.py).

  meshlm train --config experiments/mlm_shakespeare.py --workdir runs/mlm
  meshlm embed --model runs/mlm --input data/tinyshakespeare/input.txt --output /tmp/emb.npy
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

  c.model.arch = "encoder"
  c.model.vocab_size = 1032       # 1,024 BPE tokens + the mask id (+ padding to a multiple of 8)
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 4
  c.model.mlp_dim = 512
  c.model.max_seq_len = 128
  c.model.tie_embeddings = True
  c.model.norm = "layer"
  c.model.norm_position = "post"
  c.model.norm_eps = 1e-12
  c.model.mlp_activation = "gelu"
  c.model.use_bias = True
  c.model.position = "learned"
  c.model.pooling = "mean"

  c.tokenizer.train_vocab_size = 1024
  c.data.path = data_path("tinyshakespeare", "input.txt")
  c.data.task = "mlm"

  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.01
  c.sample.max_new_tokens = 0
  return c
