"""The residual block every architecture stacks, and the code that runs a stack of them.

A stack is created with `nnx.vmap` into one module whose parameters gain a
leading `layers` axis, and applied by `parallel.run_layers`: a `jax.lax.scan`,
so compile time does not grow with depth, or a pipeline when one is
configured. `cfg.remat` picks the rematerialisation policy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.layers import MLP, Attention, Norm
from models.mla import LatentAttention
from models.moe import MoE
from parallel import constrain, run_layers

_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
_RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


class Block(nnx.Module):
  """Self-attention, optional cross-attention (`cross=True`), then an MLP or MoE, each residual.

  cfg.norm_position "pre": x + f(norm(x)) (Llama, T5); "post": norm(x + f(x)) (BERT).
  Returns (x_BTD, stats): the MoE layer's router statistics, {} for a dense MLP.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool = False):
    self.post_norm = cfg.norm_position == "post"
    self.attn_norm = Norm(cfg)
    self.attn = LatentAttention(cfg, rngs) if cfg.mla else Attention(cfg, rngs)
    if cross:
      self.cross_norm = Norm(cfg)
      self.cross_attn = Attention(cfg, rngs)
    self.mlp_norm = Norm(cfg)
    self.mlp = MoE(cfg, rngs) if cfg.is_moe else MLP(cfg, rngs)
    if cfg.sandwich_norms:  # Gemma: each sublayer's output normalised before the residual
      self.post_attn_norm = Norm(cfg)
      self.post_mlp_norm = Norm(cfg)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, prefix_BT=None, enc_BSD=None,
               enc_segment_ids_BS=None, *, causal=True, bias_fn=None, layer=None):
    """`layer`: this block's index in its stack (models/layers.py: layer_window)."""
    attend = lambda h: self.attn(h, positions_BT, segment_ids_BT, causal=causal,  # noqa: E731
                                 prefix_BT=prefix_BT, bias_fn=bias_fn, layer=layer)
    x_BTD = self._residual(x_BTD, self.attn_norm,
                           lambda h: self._sandwich("post_attn_norm", attend(h)))
    x_BTD = self._cross(x_BTD, segment_ids_BT, enc_BSD, enc_segment_ids_BS)
    return self._mlp_residual(x_BTD, segment_ids_BT)

  def decode(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, cache, *, bias_fn=None,
             enc_kv=None, enc_segment_ids_BS=None, layer=None):
    """Cached block (inference): (x_BTD, layer_cache) with this chunk stored in the cache.
    enc_kv: this layer's cross-attention (k_BSKH, v_BSKH), computed once per request."""
    h_BTD = x_BTD if self.post_norm else self.attn_norm(x_BTD)
    a_BTD, layer_cache = self.attn.decode(h_BTD, positions_BT, segment_ids_BT, layer_cache, cache,
                                          bias_fn=bias_fn, layer=layer)
    a_BTD = self._sandwich("post_attn_norm", a_BTD)
    x_BTD = self.attn_norm(x_BTD + a_BTD) if self.post_norm else x_BTD + a_BTD
    x_BTD = self._cross(x_BTD, segment_ids_BT, enc_kv, enc_segment_ids_BS)
    x_BTD, _ = self._mlp_residual(x_BTD, segment_ids_BT)
    return x_BTD, layer_cache

  def _sandwich(self, name, y_BTD):
    """y_BTD normalised by the sandwich norm `name` where the block has one."""
    return getattr(self, name)(y_BTD) if hasattr(self, name) else y_BTD

  def _residual(self, x_BTD, norm, f):
    if self.post_norm:
      return norm(x_BTD + f(x_BTD))
    return x_BTD + f(norm(x_BTD))

  def _cross(self, x_BTD, segment_ids_BT, enc, enc_segment_ids_BS):
    """Cross-attention to `enc`: the encoder output enc_BSD or its (k_BSKH, v_BSKH)."""
    if enc is None:
      if hasattr(self, "cross_attn"):
        raise ValueError("this block cross-attends: pass the encoder output")
      return x_BTD
    return self._residual(x_BTD, self.cross_norm, lambda h: self.cross_attn(
        h, None, segment_ids_BT, kv_BSD=enc, kv_segment_ids_BS=enc_segment_ids_BS))

  def _mlp_residual(self, x_BTD, segment_ids_BT):
    if isinstance(self.mlp, MoE):
      f = lambda h: self.mlp(h, segment_ids_BT)  # noqa: E731
    else:
      f = lambda h: (self.mlp(h), {})  # noqa: E731
    if self.post_norm:
      y_BTD, stats = f(x_BTD)
      return constrain(self.mlp_norm(x_BTD + y_BTD), _RESIDUAL), stats
    y_BTD, stats = f(self.mlp_norm(x_BTD))
    return constrain(x_BTD + self._sandwich("post_mlp_norm", y_BTD), _RESIDUAL), stats


def make_stack(cfg: ModelConfig, rngs: nnx.Rngs, num_layers: int, **block_kwargs) -> Block:
  """`num_layers` Blocks as one module whose parameters lead with the `layers` axis."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return Block(cfg, rngs, **block_kwargs)

  return make(rngs)


def run_stack(blocks: Block, cfg: ModelConfig, x_BTD, positions_BT, segment_ids_BT,
              prefix_BT=None, enc_BSD=None, enc_segment_ids_BS=None, *, first_layer: int = 0,
              **call_kwargs):
  """x_BTD through every layer of a stack (training/prefill): (x_BTD, per-layer stats).

  `call_kwargs` (causal, bias_fn) are the same for every layer; the arrays are
  passed as layer inputs so that a pipeline can split them into microbatches.
  """
  if isinstance(blocks, list):
    raise TypeError("this model's layers were unstacked for decoding (models/layer_weights.py); "
                    "a full forward runs the stacked state: nnx.merge(graphdef, state)")
  graphdef, state = nnx.split(blocks)

  def body(x_BTD, layer_state, *aux):
    if cfg.layer_pattern:  # the layer's index rides with its state (see below)
      layer_state, layer = layer_state
      return nnx.merge(graphdef, layer_state)(x_BTD, *aux, layer=layer, **call_kwargs)
    return nnx.merge(graphdef, layer_state)(x_BTD, *aux, **call_kwargs)

  if cfg.remat != "none":
    body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=not cfg.scan_layers)
  aux = (positions_BT, segment_ids_BT, prefix_BT, enc_BSD, enc_segment_ids_BS)
  if cfg.layer_pattern:
    # Local/global layers need their index: scanned (and pipelined) with the layers' state;
    # unscanned, each layer gets a static (numpy) index, so its window is static too.
    # `first_layer`: the index of the stack's first layer (a stack cut in parts).
    state = (state, first_layer + np.arange(_depth(state), dtype=np.int32))
  return run_layers(body, x_BTD, state, aux, scan=cfg.scan_layers)


def _depth(state) -> int:
  return jax.tree.leaves(state)[0].shape[0]


def decode_stack(blocks: Block, x_BTD, positions_BT, segment_ids_BT, layers_cache, cache,
                 per_layer=None, *, first_layer: int = 0, **call_kwargs):
  """Cached pass through a stack (inference): (x_BTD, layers_cache).

  `per_layer`: {Block.decode keyword: pytree with a leading layer axis}, each layer
  getting its own slice (an encoder-decoder's cross-attention keys and values).
  A scan over the stacked layers; `blocks` a list of per-layer Blocks
  (models/layer_weights.py) runs them one after another, unrolled, and stacks their outputs.
  `first_layer`: the index of the stack's first layer (a stack cut in parts).
  """
  if isinstance(blocks, list):
    outs = []
    for i, block in enumerate(blocks):
      at = lambda tree, i=i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
      x_BTD, out = block.decode(x_BTD, positions_BT, segment_ids_BT, at(layers_cache), cache,
                                **call_kwargs, **at(per_layer or {}),
                                **_index(block, first_layer + i))
      outs.append(out)
    return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *outs)
  graphdef, state = nnx.split(blocks)
  per_layer = dict(per_layer or {})
  if blocks.attn.cfg.layer_pattern:
    per_layer["layer"] = first_layer + jnp.arange(_depth(state), dtype=jnp.int32)

  def body(x_BTD, xs):
    layer_state, layer_cache, mine = xs
    return nnx.merge(graphdef, layer_state).decode(x_BTD, positions_BT, segment_ids_BT,
                                                   layer_cache, cache, **call_kwargs, **mine)

  return jax.lax.scan(body, x_BTD, (state, layers_cache, per_layer))


def _index(block: Block, i: int) -> dict:
  """{"layer": i} for a block whose kind depends on its index (cfg.layer_pattern), else {}."""
  return {"layer": i} if block.attn.cfg.layer_pattern else {}
