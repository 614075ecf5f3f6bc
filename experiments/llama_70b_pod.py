"""Llama-3-70B-class pretraining on 256 devices: pipeline x FSDP x tensor parallel.

4 pipeline stages (circular schedule, 2 repeats: each device holds two chunks of
10 layers; 16 microbatches: bubble 3/35 = 8.6%), FSDP over 8, and Megatron
tensor parallelism with sequence parallelism over 8 (the 8 key/value heads
bound it: keep `tensor` within a node's fast links). Plan it, then compile it for its
target, a v5p slice of 256 chips (deviceless; docs/accelerators.md):

  meshlm plan --config experiments/llama_70b_pod.py --devices 256 --budget_gb 80 --compile
  meshlm plan --config experiments/llama_70b_pod.py --target v5p:4x8x8 --compile

Train it (set the data and a Llama-3 tokenizer first; one process per host):

  meshlm train --config experiments/llama_70b_pod.py --workdir runs/llama_70b \\
      --config.data.path=DATA --config.tokenizer.path=TOKENIZER_DIR
"""

from experiments.llama3_8b_pod import get_config as llama3_8b_config


def get_config():
  """The Llama-3-8B pod config (vocabulary, RoPE, numerics, schedule) at 70B sizes."""
  c = llama3_8b_config()
  c.grad_accum = 2          # halves the logits, computed for a whole model call at once

  c.model.d_model = 8192
  c.model.num_layers = 80
  c.model.num_heads = 64
  c.model.mlp_dim = 28672

  c.optimizer.lr = 1.5e-4

  c.mesh = dict(data=1, fsdp=8, tensor=8, pipeline=4, expert=1, sequence=1)
  c.sharding = "pipeline+fsdp+tensor+sequence"
  c.pipeline.microbatches = 16   # 128 rows per call -> 16 microbatches of 8: a row per FSDP shard
  c.pipeline.repeats = 2
  c.pipeline.schedule = "circular"
  return c
