"""The decoder-only model (Llama-style), optionally a prefix-LM: embeddings, a stack of
blocks (models/blocks.py), the unembedding.

arch="prefix_lm" (the hybrid) lets the tokens marked in `prefix_BT` (the prompt)
attend to each other both ways, encoder-style, and generates causally after
them; arch="decoder" ignores no input and is causal throughout.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.blocks import Block, decode_stack, make_stack, run_stack
from models.config import ModelConfig
from models.embedding import Embeddings
from models.layers import Norm
from models.positions import RelativePositionBias, default_positions

__all__ = ["Block", "Transformer"]


class Transformer(Embeddings):
  """tokens_BT -> logits_BTV (float32); with return_stats, (logits_BTV, per-layer stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    if cfg.arch not in ("decoder", "prefix_lm"):
      raise ValueError(f"Transformer is the decoder-only model; arch={cfg.arch!r} is built by "
                       "models.create_model")
    self.cfg = cfg
    self._init_embeddings(cfg, rngs)
    if cfg.position == "relative":
      self.rel_bias = RelativePositionBias(cfg, rngs, bidirectional=False)
    if cfg.first_dense_layers:  # DeepSeek: the first k blocks dense, a stack of their own
      self.dense_blocks = make_stack(cfg.dense_config, rngs, cfg.first_dense_layers)
    self.blocks = make_stack(cfg, rngs, cfg.num_layers - cfg.first_dense_layers)
    if cfg.norm_position == "pre":  # post-norm blocks end normalised already
      self.final_norm = Norm(cfg)
    self._init_unembed(cfg, rngs)

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, prefix_BT=None,
               return_stats=False):
    """prefix_BT (arch="prefix_lm" only): 1 marks the bidirectional prompt tokens of a row."""
    x_BTD, stats = self.hidden(tokens_BT, positions_BT, segment_ids_BT, prefix_BT=prefix_BT,
                               return_stats=True)
    logits_BTV = self.unembed(x_BTD)
    return (logits_BTV, stats) if return_stats else logits_BTV

  def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, prefix_BT=None,
             return_stats=False):
    """The final hidden states x_BTD (after the final norm): what the unembedding, and the
    scalar heads of reward and value models, read."""
    cfg = self.cfg
    if prefix_BT is not None and cfg.arch != "prefix_lm":
      raise ValueError(f"prefix_BT is the prefix-LM's input; this model has arch={cfg.arch!r}")
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT)
    x_BTD = self.embed(tokens_BT, positions_BT)
    k = cfg.first_dense_layers
    if k:
      x_BTD, _ = run_stack(self.dense_blocks, cfg.dense_config, x_BTD, positions_BT,
                           segment_ids_BT, prefix_BT, bias_fn=self.bias_fn())
    x_BTD, stats = run_stack(self.blocks, cfg, x_BTD, positions_BT, segment_ids_BT, prefix_BT,
                             bias_fn=self.bias_fn(), first_layer=k)
    x_BTD = self.final_hidden(x_BTD)
    return (x_BTD, stats) if return_stats else x_BTD

  def decode(self, tokens_BT, positions_BT, segment_ids_BT, layers_cache, cache, last_B=None):
    """Cached forward (inference; infer/ drives it): (logits, layers_cache).

    `layers_cache` is a pytree whose leaves have a leading layer axis; each
    layer's slice goes to `cache.attend` (see Attention.decode), which writes
    this chunk's keys and values and attends over the cache. With `last_B`,
    returns logits_BV at chunk position last_B[b] only (all plain sampling
    needs); without, logits_BTV at every position (speculative verification).
    A scan over layers, or a loop over per-layer Blocks where models/layer_weights.py
    unstacked them; pipelines are for training.
    """
    x_BTD = self.embed(tokens_BT, positions_BT)
    k = self.cfg.first_dense_layers
    if k:  # each stack its own layers of the cache
      part = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], layers_cache)  # noqa: E731
      x_BTD, dense_cache = decode_stack(self.dense_blocks, x_BTD, positions_BT, segment_ids_BT,
                                        part(0, k), cache, bias_fn=self.bias_fn())
      x_BTD, rest_cache = decode_stack(self.blocks, x_BTD, positions_BT, segment_ids_BT,
                                       part(k, None), cache, bias_fn=self.bias_fn(),
                                       first_layer=k)
      layers_cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), dense_cache, rest_cache)
    else:
      x_BTD, layers_cache = decode_stack(self.blocks, x_BTD, positions_BT, segment_ids_BT,
                                         layers_cache, cache, bias_fn=self.bias_fn())
    if last_B is None:
      return self.logits(x_BTD), layers_cache
    x_B1D = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)
    return self.logits(x_B1D)[:, 0], layers_cache

  def bias_fn(self):
    """The relative position bias every block's attention adds (models.blocks.run_stack's
    `bias_fn`), or None."""
    return self.rel_bias.bias_fn() if self.cfg.position == "relative" else None

  def final_hidden(self, x_BTD):
    """The final hidden states of the last block's output x_BTD: the final norm of a pre-norm
    stack (post-norm blocks end normalised already)."""
    return self.final_norm(x_BTD) if self.cfg.norm_position == "pre" else x_BTD

  def logits(self, x_BTD):
    """logits_BTV (float32) of the last block's output x_BTD: final norm, then unembedding."""
    return self.unembed(self.final_hidden(x_BTD))
