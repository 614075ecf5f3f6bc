"""The MoE study's variants of experiments/moe_shakespeare.py (one config per variant).

  meshlm train --config experiments/moe_study.py:moe_bias --workdir runs/moe_study/moe_bias
  python -m benchmarks.moe_study --workdir runs/moe_study --plot docs/img/moe_study.png

Variants: `moe` (8 experts top-2, aux loss 0.05), `moe_no_aux` (aux weight 0),
`moe_bias` (auxiliary-loss-free balancing bias, aux weight 0) and `dense`
(one SwiGLU of mlp_dim 352 = top_k x expert width: the same active parameters
per token, without the 8x128 routers).
"""

from experiments.moe_shakespeare import get_config as moe_config

VARIANTS = {
    "moe": {},
    "moe_no_aux": {"model.aux_loss_weight": 0.0},
    "moe_bias": {"model.aux_loss_weight": 0.0, "model.router_bias_rate": 1e-3},
    "dense": {"model.num_experts": 0, "model.mlp_dim": 352},
}
BALANCE_FROM_STEP = 300  # the "after 300 steps"


def get_config(variant: str = "moe"):
  c = moe_config()
  c.eval_batches = 16
  c.checkpoint_every = 100  # held-out expert load is measured at every kept checkpoint >= 300
  c.keep_checkpoints = 10
  for key, value in VARIANTS[variant].items():
    section, name = key.split(".")
    c[section][name] = value
  return c
