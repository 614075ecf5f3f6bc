"""The Llama-style decoder: embeddings, a stack of pre-norm blocks, and the unembedding.

The blocks are created with `nnx.vmap` into one stacked module whose parameters
gain a leading `layers` axis, and applied by `parallel.run_layers`: a
`jax.lax.scan`, so compile time does not grow with depth, or a pipeline when one
is configured. `cfg.remat` picks the rematerialisation policy.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import MLP, Attention, RMSNorm, _param, lookup, project
from models.moe import MoE
from parallel import constrain, run_layers

_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); the MLP may be an MoE.

  Returns (x_BTD, stats): the MoE layer's router statistics, {} for a dense MLP.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp = MoE(cfg, rngs) if cfg.is_moe else MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT)
    return self._mlp_residual(x_BTD, segment_ids_BT)

  def decode(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, cache):
    """Cached block (inference): (x_BTD, layer_cache) with this chunk stored in the cache."""
    a_BTD, layer_cache = self.attn.decode(self.attn_norm(x_BTD), positions_BT, segment_ids_BT,
                                          layer_cache, cache)
    x_BTD, _ = self._mlp_residual(x_BTD + a_BTD, segment_ids_BT)
    return x_BTD, layer_cache

  def _mlp_residual(self, x_BTD, segment_ids_BT):
    if isinstance(self.mlp, MoE):
      y_BTD, stats = self.mlp(self.mlp_norm(x_BTD), segment_ids_BT)
    else:
      y_BTD, stats = self.mlp(self.mlp_norm(x_BTD)), {}
    return constrain(x_BTD + y_BTD, ("act_batch", "act_res_seq", "act_embed")), stats


class Transformer(nnx.Module):
  """tokens_BT -> logits_BTV (float32); with return_stats, (logits_BTV, per-layer stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_VD = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg,
                           cfg.init_std)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.unembed_DV = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg,
                               cfg.init_std)

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, return_stats=False):
    cfg = self.cfg
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    x_BTD = self._embed(tokens_BT)
    graphdef, state = nnx.split(self.blocks)

    def body(x_BTD, layer_state, positions_BT, segment_ids_BT):
      return nnx.merge(graphdef, layer_state)(x_BTD, positions_BT, segment_ids_BT)

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=not cfg.scan_layers)
    x_BTD, stats = run_layers(body, x_BTD, state, (positions_BT, segment_ids_BT),
                              scan=cfg.scan_layers)
    logits_BTV = self._logits(x_BTD)
    return (logits_BTV, stats) if return_stats else logits_BTV

  def decode(self, tokens_BT, positions_BT, segment_ids_BT, layers_cache, cache, last_B=None):
    """Cached forward (inference; infer/ drives it): (logits, layers_cache).

    `layers_cache` is a pytree whose leaves have a leading layer axis; each
    layer's slice goes to `cache.attend` (see Attention.decode), which writes
    this chunk's keys and values and attends over the cache. With `last_B`,
    returns logits_BV at chunk position last_B[b] only (all plain sampling
    needs); without, logits_BTV at every position (speculative verification).
    Always a scan over layers; pipelines are for training.
    """
    x_BTD = self._embed(tokens_BT)
    graphdef, state = nnx.split(self.blocks)

    def body(x_BTD, xs):
      layer_state, layer_cache = xs
      return nnx.merge(graphdef, layer_state).decode(x_BTD, positions_BT, segment_ids_BT,
                                                     layer_cache, cache)

    x_BTD, layers_cache = jax.lax.scan(body, x_BTD, (state, layers_cache))
    if last_B is None:
      return self._logits(x_BTD), layers_cache
    x_B1D = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)
    return self._logits(x_B1D)[:, 0], layers_cache

  def _embed(self, tokens_BT):
    x_BTD = lookup(self.embed_VD, tokens_BT, self.cfg.jnp_dtype)
    return constrain(x_BTD, ("act_batch", "act_res_seq", "act_embed"))

  def _logits(self, x_BTD):
    """Final norm and unembedding, in float32."""
    cfg = self.cfg
    x_BTD = self.final_norm(x_BTD)
    if cfg.tie_embeddings:
      logits_BTV = project("BTD,VD->BTV", x_BTD, self.embed_VD, cfg.jnp_dtype,
                           preferred_element_type=jnp.float32)
    else:
      logits_BTV = project("BTD,DV->BTV", x_BTD, self.unembed_DV, cfg.jnp_dtype,
                           preferred_element_type=jnp.float32)
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))


def abstract_model(cfg: ModelConfig) -> Transformer:
  """A Transformer whose params are ShapeDtypeStructs: shapes, dtypes and logical names only.

  Built outside any ambient mesh: the logical names are mapped to mesh axes by
  `parallel/`, not by flax's eval_shape.
  """
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
