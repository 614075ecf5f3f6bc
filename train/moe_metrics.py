"""MoE bookkeeping inside the train step: router losses, logged metrics, the balancing bias.

`stats` is what the model returns with `return_stats=True`: per-layer arrays
stacked over L (models/moe.py `router_stats`), or {} for a dense model.
"""

import jax
import jax.numpy as jnp


def router_loss(cfg, stats) -> jax.Array:
  """aux_loss_weight * mean-over-layers balancing loss + z_loss_weight * mean z-loss."""
  if not stats:
    return jnp.zeros((), jnp.float32)
  return (cfg.aux_loss_weight * jnp.mean(stats["aux_loss"])
          + cfg.z_loss_weight * jnp.mean(stats["z_loss"]))


def load_fractions(stats) -> jax.Array:
  """load_LE: each layer's share of routed choices per expert."""
  load_LE = stats["load"]
  return load_LE / jnp.maximum(jnp.sum(load_LE, axis=-1, keepdims=True), 1e-9)


def router_metrics(cfg, stats) -> dict:
  """Scalars for metrics.jsonl/TensorBoard: losses, entropy, drop rate and expert loads.

  moe/load_max_over_mean is the worst layer's max/mean expert load (1 = balanced);
  moe/load_eI is expert I's share of the choices, averaged over layers.
  """
  if not stats:
    return {}
  frac_LE = load_fractions(stats)
  choices = jnp.maximum(jnp.sum(stats["tokens"]) * cfg.top_k, 1.0)
  out = {
      "moe/aux_loss": jnp.mean(stats["aux_loss"]),
      "moe/z_loss": jnp.mean(stats["z_loss"]),
      "moe/router_entropy": jnp.mean(stats["entropy"]),
      "moe/drop_rate": jnp.sum(stats["dropped"]) / choices,
      "moe/load_max_over_mean": jnp.max(jnp.max(frac_LE, -1) * frac_LE.shape[-1]),
  }
  mean_E = jnp.mean(frac_LE, axis=0)
  out.update({f"moe/load_e{e}": mean_E[e] for e in range(cfg.num_experts)})
  return out


def update_router_bias(cfg, new_params, old_params, stats):
  """Auxiliary-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean load - load_e).

  Applied in place of whatever the optimizer did to the bias (it gets no gradient).
  """
  if not stats or not cfg.router_bias_rate:
    return new_params
  frac_LE = load_fractions(stats)
  step_LE = cfg.router_bias_rate * jnp.sign(jnp.mean(frac_LE, -1, keepdims=True) - frac_LE)

  def one(path, new, old):
    if any(getattr(k, "key", None) == "router_bias_E" for k in path):
      return old + step_LE.astype(old.dtype)
    return new

  return jax.tree_util.tree_map_with_path(one, new_params, old_params)
