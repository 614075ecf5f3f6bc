"""Llama-3-8B-class pretraining on 64 devices: FSDP over all of them, bf16 compute.

Plan it (estimates, AOT compile on 64 fake CPU devices, other layouts within 80 GiB), then
compile it for its target, a v5p slice of 64 chips, with the TPU's own compiler (deviceless;
docs/accelerators.md):

  meshlm plan --config experiments/llama3_8b_pod.py --devices 64 --budget_gb 80 --compile
  meshlm plan --config experiments/llama3_8b_pod.py --target v5p:4x4x4 --compile

Train it (set the data and a Llama-3 tokenizer first; one process per host):

  meshlm train --config experiments/llama3_8b_pod.py --workdir runs/llama3_8b \\
      --config.data.path=DATA --config.tokenizer.path=TOKENIZER_DIR

Each device takes one 8192-token row per microbatch (grad_accum=4 keeps 256 rows = 2M
tokens per step): where no flash kernel runs (CPUs), a layer's scores are
batch·heads·seq² floats, 8 GiB per row in float32. On a TPU, `--config.model.xent=chunked`
(models/xent.py) fuses the loss with the unembedding and holds 9.73 GiB per chip instead
of 13.75 (docs/results.md, "Compiled for the target").
"""

from train.defaults import base_config


def get_config():
  c = base_config()
  c.steps = 10_000
  c.batch_size = 256
  c.seq_len = 8192
  c.grad_accum = 4
  c.log_every = 10
  c.eval_every = 500
  c.checkpoint_every = 500

  c.model.vocab_size = 128256
  c.model.d_model = 4096
  c.model.num_layers = 32
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 14336
  c.model.rope_theta = 500000.0
  c.model.norm_eps = 1e-5
  c.model.max_seq_len = 8192
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"

  c.optimizer.lr = 3e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1

  c.mesh = dict(data=1, fsdp=-1, tensor=1, pipeline=1, expert=1, sequence=1)
  c.sharding = "fsdp"
  return c
