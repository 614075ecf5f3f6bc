"""Scalar heads on a decoder backbone: reward models (one score per row) and value models
(one value per token).

  values_BT[b, t] = x_BTD[b, t] . w_D + bias        x_BTD = backbone.hidden(...) (float32)
  rewards_B[b]    = values_BT[b, last_B[b]]

In an align/data.py batch the model reads inputs = ids[:-1], so the final EOS never enters
it; a row's reward is read at its last input position whose target is a response token,
the state that has read prompt + whole response (the appended EOS is constant and carries
no information). Callers holding whole sequences pass `last_B` to `rewards_at` directly.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from align.logprobs import response_mask
from models.config import ModelConfig
from models.registry import create_model, model_inputs


class ScalarHead(nnx.Module):
  """x_BTD -> x_BTD . w_D + bias, in float32. `std` = 0 starts every score at 0 (a value
  model's usual start); a small std breaks the symmetry for a reward model."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, std: float = 0.0):
    w_D = std * jax.random.normal(rngs.params(), (cfg.d_model,), jnp.float32)
    # Logical names as in models/layers.py: parallel/ maps them to mesh axes.
    self.w = nnx.Param(w_D.astype(cfg.jnp_param_dtype), out_sharding=("embed",),
                       eager_sharding=False)
    self.bias = nnx.Param(jnp.zeros((), cfg.jnp_param_dtype), out_sharding=(),
                          eager_sharding=False)

  def __call__(self, x_BTD):
    w_D = self.w[...].astype(jnp.float32)
    return jnp.einsum("BTD,D->BT", x_BTD.astype(jnp.float32), w_D) + \
        self.bias[...].astype(jnp.float32)


def last_response_index(batch):
  """last_B: each row's last position with a counted (response) target; 0 for a row with none."""
  mask_BT = response_mask(batch) > 0
  idx_BT = jnp.broadcast_to(jnp.arange(mask_BT.shape[1]), mask_BT.shape)
  return jnp.maximum(jnp.max(jnp.where(mask_BT, idx_BT, -1), axis=-1), 0)


class RewardModel(nnx.Module):
  """A Transformer backbone (models.Transformer, any decoder config) + a ScalarHead."""

  def __init__(self, backbone: nnx.Module, rngs: nnx.Rngs, head_std: float = 0.0):
    if not hasattr(backbone, "hidden"):
      raise ValueError(f"RewardModel needs a decoder backbone with .hidden(); got "
                       f"{type(backbone).__name__}")
    self.cfg = backbone.cfg
    self.backbone = backbone
    self.head = ScalarHead(backbone.cfg, rngs, head_std)

  @classmethod
  def create(cls, cfg: ModelConfig, rngs: nnx.Rngs, head_std: float = 0.0) -> "RewardModel":
    return cls(create_model(cfg, rngs), rngs, head_std)

  def values(self, tokens_BT, positions_BT=None, segment_ids_BT=None, **kwargs):
    """values_BT: the head at every position (a value model's V(s_t))."""
    return self.head(self.backbone.hidden(tokens_BT, positions_BT, segment_ids_BT, **kwargs))

  def rewards_at(self, tokens_BT, positions_BT, segment_ids_BT, last_B, **kwargs):
    """rewards_B: the head at position last_B[b] of row b."""
    values_BT = self.values(tokens_BT, positions_BT, segment_ids_BT, **kwargs)
    return jnp.take_along_axis(values_BT, last_B[:, None].astype(jnp.int32), axis=1)[:, 0]

  def __call__(self, batch):
    """rewards_B of an align/data.py batch, read at each row's last response position."""
    return self.rewards_at(batch["inputs"], batch["positions"], batch["segment_ids"],
                           last_response_index(batch), **model_inputs(self.cfg, batch))

  def batch_values(self, batch):
    """values_BT of a batch, 0 at padding."""
    values_BT = self.values(batch["inputs"], batch["positions"], batch["segment_ids"],
                            **model_inputs(self.cfg, batch))
    return jnp.where(batch["segment_ids"] > 0, values_BT, 0.0)


def forward_rewards(graphdef, params, batch):
  """RewardModel.__call__ as a pure function of (graphdef, params, batch)."""
  return nnx.merge(graphdef, params)(batch)
