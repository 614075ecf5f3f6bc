"""Mixture of experts on Tiny Shakespeare: 8 SwiGLU experts per block, top-2, dropless.

The quickstart model with each dense MLP (mlp_dim 352) replaced by 8 experts of
mlp_dim 176: two experts per token give the same active parameters per token
as the dense model (plus a 128x8 router per block), with 4x the MLP weights.

  meshlm train --config experiments/moe_shakespeare.py --workdir runs/moe_shakespeare

Variants from the command line: --config.model.aux_loss_weight=0 (no balancing),
--config.model.moe_impl=capacity --config.model.capacity_factor=1.25 (GShard),
--config.model.router_bias_rate=1e-3 --config.model.aux_loss_weight=0
(auxiliary-loss-free balancing). benchmarks/moe_study.py runs the comparison
with the dense model for docs/results.md.
"""

from experiments.quickstart import get_config as quickstart_config


def get_config():
  c = quickstart_config()
  c.model.num_experts = 8
  c.model.top_k = 2
  c.model.mlp_dim = 176          # per expert; top-2 -> 352 active, the quickstart's dense width
  c.model.moe_impl = "dropless"
  c.model.router_norm = "topk"
  # Our balancing loss is 1 at uniform load (HF Mixtral's is top_k): 0.05 here is HF's 0.025.
  c.model.aux_loss_weight = 0.05
  c.model.z_loss_weight = 1e-3
  c.sample.max_new_tokens = 0
  return c
