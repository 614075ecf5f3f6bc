"""Token embeddings in and logits out, the same for every architecture.

`Embeddings` is mixed into each model class, so the tables keep their short
names (`embed_VD`, `unembed_DV`, `pos_PD`, `type_YD`) at the top of every
model and checkpoint converters, quantization and sharding see one layout.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models import xent
from models.config import ModelConfig
from models.layers import Norm, cast, lookup, normal_param, project
from parallel import constrain


class Embeddings(nnx.Module):
  """Token (+ learned position, + token type) embeddings; a tied or separate unembedding."""

  def _init_embeddings(self, cfg: ModelConfig, rngs: nnx.Rngs):
    std = cfg.init_std
    self.embed_VD = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg, std)
    if cfg.position == "learned":
      self.pos_PD = normal_param(rngs, (cfg.max_seq_len, cfg.d_model), ("positions", "embed"), cfg,
                                 std)
    if cfg.type_vocab_size:
      self.type_YD = normal_param(rngs, (cfg.type_vocab_size, cfg.d_model), ("types", "embed"),
                                  cfg, std)
    if cfg.norm_position == "post":
      # Post-norm blocks take normalised inputs: BERT normalises the embedding sum.
      self.embed_norm = Norm(cfg)

  def _init_unembed(self, cfg: ModelConfig, rngs: nnx.Rngs):
    """A separate output table unless the embeddings are tied (created last: the init order
    decides which random numbers each table gets)."""
    if not cfg.tie_embeddings:
      self.unembed_DV = normal_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg,
                                     cfg.init_std)

  def embed(self, tokens_BT, positions_BT=None, type_ids_BT=None):
    """x_BTD, the first block's input: token (+ position, + type) embeddings in the compute
    dtype (normalised for post-norm blocks)."""
    cfg = self.cfg
    dt = cfg.jnp_dtype
    x_BTD = lookup(self.embed_VD, tokens_BT, dt)
    if cfg.embed_scale:  # Gemma: the table is shared with the output, the input scaled up
      x_BTD = x_BTD * jnp.asarray(cfg.d_model ** 0.5, dt)
    if cfg.position == "learned":
      x_BTD = x_BTD + lookup(self.pos_PD, positions_BT, dt)
    if cfg.type_vocab_size:
      types_BT = jnp.zeros_like(tokens_BT) if type_ids_BT is None else type_ids_BT
      x_BTD = x_BTD + lookup(self.type_YD, types_BT, dt)
    if cfg.norm_position == "post":
      x_BTD = self.embed_norm(x_BTD)
    return constrain(x_BTD, ("act_batch", "act_res_seq", "act_embed"))

  def unembed(self, x_BTD):
    """logits_BTV in float32 from final hidden states (already normalised)."""
    cfg = self.cfg
    # Sequence parallelism splits the residual's positions over `tensor`, which the vocabulary
    # also uses: gather them first (as before any tensor-parallel matmul), else the SPMD
    # partitioner may all-gather the logits' gradient over the batch axes for the table's
    # gradient (docs/parallelism.md). A no-op without sequence parallelism.
    x_BTD = constrain(x_BTD, ("act_batch", "act_seq", "act_embed"))
    if cfg.tie_embeddings:
      logits_BTV = project("BTD,VD->BTV", x_BTD, self.embed_VD, cfg.jnp_dtype, cfg.matmul,
                           preferred_element_type=jnp.float32)
    else:
      logits_BTV = project("BTD,DV->BTV", x_BTD, self.unembed_DV, cfg.jnp_dtype, cfg.matmul,
                           preferred_element_type=jnp.float32)
    if cfg.final_softcap:  # Gemma 2
      logits_BTV = jnp.tanh(logits_BTV / cfg.final_softcap) * cfg.final_softcap
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))

  def _out_table(self):
    return self.embed_VD if self.cfg.tie_embeddings else self.unembed_DV

  def chunked_xent(self) -> bool:
    """Whether training takes the fused unembedding + loss (models/xent.py): config key
    `xent`="chunked", on a decoder whose table is a plain array (not a quantized one)."""
    cfg = self.cfg
    return (cfg.xent == "chunked" and cfg.arch in ("decoder", "prefix_lm")
            and isinstance(self._out_table()[...], jax.Array))

  def xent_sum(self, x_BTD, targets_BT, weights_BT) -> jax.Array:
    """sum(weights_BT * CE(logits_BTV, targets_BT)) from final hidden states, without ever
    holding logits_BTV whole: what `token_losses` of `unembed` gives, summed."""
    x_BTD = constrain(x_BTD, ("act_batch", "act_seq", "act_embed"))  # as `unembed` gathers it
    return xent.xent_sum(x_BTD, cast(self._out_table(), self.cfg.jnp_dtype), targets_BT, weights_BT,
                         vocab_major=self.cfg.tie_embeddings, dtype=self.cfg.jnp_dtype,
                         unroll=self.cfg.xent_unroll)
