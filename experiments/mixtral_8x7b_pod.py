"""Mixtral-8x7B-class mixture-of-experts pretraining on 64 devices: expert x FSDP parallelism.

Eight SwiGLU experts per layer (each of model.mlp_dim), two routed per token;
experts are split over `expert` (8) and every weight over `fsdp` (8). The MoE
keys live in `config.moe`; the planner accounts for them (expert weights,
routed activations, all-to-alls). Plan it:

  meshlm plan --config experiments/mixtral_8x7b_pod.py --devices 64 --budget_gb 80

Until models/ has MoE layers, `--compile` skips the AOT check for this config
(the real train step would be the dense model) and `meshlm train` would train
a dense model of the same shape.
"""

from ml_collections import ConfigDict

from experiments.defaults import base_config


def get_config():
  c = base_config()
  c.steps = 10_000
  c.batch_size = 256
  c.seq_len = 4096
  c.grad_accum = 2
  c.log_every = 10
  c.eval_every = 500
  c.checkpoint_every = 500

  c.model.vocab_size = 32000
  c.model.d_model = 4096
  c.model.num_layers = 32
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 14336        # per expert
  c.model.rope_theta = 1e6
  c.model.norm_eps = 1e-5
  c.model.max_seq_len = 4096
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"

  if "moe" not in c:
    c.moe = ConfigDict()
  c.moe.num_experts = 8
  c.moe.top_k = 2
  c.moe.capacity_factor = 1.0

  c.optimizer.lr = 3e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1

  c.mesh = dict(data=1, fsdp=8, tensor=1, pipeline=1, expert=8, sequence=1)
  c.sharding = "fsdp+expert"
  return c
