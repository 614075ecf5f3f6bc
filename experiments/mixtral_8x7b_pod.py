"""Mixtral-8x7B-class mixture-of-experts pretraining on 64 devices: expert x FSDP parallelism.

Eight SwiGLU experts per layer (each of model.mlp_dim), two routed per token
(dropless, Mixtral's top-2 renormalised gating); experts are split over
`expert` (8) and every weight over `fsdp` (8), tokens exchanged with
all-to-all. The planner accounts for the MoE keys (expert weights, routed
activations, all-to-alls). Plan it, compile it for its target (a v5p slice of 64 chips,
deviceless; docs/accelerators.md), then train it:

  meshlm plan --config experiments/mixtral_8x7b_pod.py --devices 64 --budget_gb 80 --compile
  meshlm plan --config experiments/mixtral_8x7b_pod.py --target v5p:4x4x4 --compile
  meshlm train --config experiments/mixtral_8x7b_pod.py --workdir gs://BUCKET/mixtral
"""

from train.defaults import base_config


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

  c.model.num_experts = 8
  c.model.top_k = 2
  c.model.moe_impl = "dropless"
  c.model.grouped_matmul = "ragged_dot"  # the accelerator kernel, also what `meshlm plan --compile` sizes
  c.model.aux_loss_weight = 0.02   # Mixtral's router_aux_loss_coef 0.01 x top_k (our loss is 1 at balance)

  c.optimizer.lr = 3e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1

  c.mesh = dict(data=1, fsdp=8, tensor=1, pipeline=1, expert=8, sequence=1)
  c.sharding = "fsdp+expert"
  return c
