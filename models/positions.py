"""Position information besides rotary embeddings: T5's relative position bias.

Learned absolute positions are a table in the embeddings (models/embedding.py);
rotary embeddings are applied inside Attention (models/layers.py).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import normal_param


def relative_buckets(rel_BTS, *, bidirectional: bool, num_buckets: int, max_distance: int):
  """Bucket of each offset rel = key position - query position (T5).

  Half the buckets (per direction when bidirectional) hold small offsets
  exactly; the rest cover offsets up to `max_distance` log-spaced, beyond
  which everything shares the last bucket. Unidirectional (a decoder): keys
  ahead of the query all fall in bucket 0, which the causal mask hides anyway.
  """
  rel_BTS = rel_BTS.astype(jnp.int32)
  base = jnp.zeros_like(rel_BTS)
  if bidirectional:
    num_buckets //= 2
    base = jnp.where(rel_BTS > 0, num_buckets, 0)
    distance = jnp.abs(rel_BTS)
  else:
    distance = -jnp.minimum(rel_BTS, 0)
  exact = num_buckets // 2
  # Offsets below `exact` would take log(0); they use the exact branch.
  ratio = jnp.maximum(distance, 1).astype(jnp.float32) / exact
  log_bucket = exact + (jnp.log(ratio) / math.log(max_distance / exact)
                        * (num_buckets - exact)).astype(jnp.int32)
  log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
  return base + jnp.where(distance < exact, distance, log_bucket)


class RelativePositionBias(nnx.Module):
  """A learned bias per (bucket, head), added to the attention scores of every layer of a stack."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, bidirectional: bool):
    self.bidirectional = bidirectional
    self.num_buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
    self.table_RN = normal_param(rngs, (cfg.relative_buckets, cfg.num_heads),
                                 ("rel_buckets", "heads"), cfg, cfg.init_std)

  def bias_fn(self):
    """`bias_fn(q_pos_BT, kv_pos_BS) -> bias_BNTS` for models.attention (closes over the table)."""
    table_RN = self.table_RN[...]

    def fn(q_pos_BT, kv_pos_BS):
      buckets_BTS = relative_buckets(kv_pos_BS[:, None, :] - q_pos_BT[:, :, None],
                                     bidirectional=self.bidirectional,
                                     num_buckets=self.num_buckets, max_distance=self.max_distance)
      return jnp.moveaxis(jnp.take(table_RN, buckets_BTS, axis=0), -1, 1).astype(jnp.float32)

    return fn


def default_positions(tokens_BT) -> jax.Array:
  """Positions 0..T-1 in every row (an unpacked batch)."""
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
