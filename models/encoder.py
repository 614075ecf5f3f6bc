"""The encoder-only model (BERT-style): bidirectional blocks, pooling, a classification head.

    model = create_model(cfg)                 # cfg.arch == "encoder"
    hidden_BTD = model.encode(tokens_BT, segment_ids_BT=mask_BT)
    emb_BD = model.embed_sentences(tokens_BT, mask_BT)   # pooled, L2-normalised
    logits_BTV = model(tokens_BT, ...)        # masked-LM logits (tied), what training uses

The blocks are the shared ones (models/blocks.py) called with causal=False.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.blocks import make_stack, run_stack
from models.config import ModelConfig
from models.embedding import Embeddings
from models.layers import Norm, normal_param, zeros_param
from models.positions import RelativePositionBias, default_positions
from parallel import constrain


def pool(x_BTD, mask_BT, kind: str) -> jax.Array:
  """Sentence vectors x_BD, in float32: "mean" over the real tokens (mask 1) or "cls" (token 0)."""
  x = x_BTD.astype(jnp.float32)
  if kind == "cls":
    return x[:, 0]
  m_BT1 = (mask_BT > 0).astype(jnp.float32)[..., None]
  return jnp.sum(x * m_BT1, axis=1) / jnp.maximum(jnp.sum(m_BT1, axis=1), 1e-9)


def normalize(x_BD, eps: float = 1e-12) -> jax.Array:
  """Rows scaled to unit L2 norm (sentence-transformers' Normalize)."""
  return x_BD / jnp.maximum(jnp.linalg.norm(x_BD, axis=-1, keepdims=True), eps)


class Encoder(Embeddings):
  """tokens_BT -> hidden states; pooling and an optional classifier on top."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    if cfg.arch != "encoder":
      raise ValueError(f"Encoder needs arch='encoder', got {cfg.arch!r}")
    self.cfg = cfg
    self._init_embeddings(cfg, rngs)
    if cfg.position == "relative":
      self.rel_bias = RelativePositionBias(cfg, rngs, bidirectional=True)
    self.blocks = make_stack(cfg, rngs, cfg.num_layers)
    if cfg.norm_position == "pre":  # post-norm blocks end normalised already
      self.final_norm = Norm(cfg)
    self._init_unembed(cfg, rngs)
    if cfg.num_classes:
      self.classifier_DC = normal_param(rngs, (cfg.d_model, cfg.num_classes), ("embed", None),
                                        cfg, cfg.init_std)
      self.classifier_C = zeros_param((cfg.num_classes,), (None,), cfg)

  def encode(self, tokens_BT, positions_BT=None, segment_ids_BT=None, type_ids_BT=None,
             *, return_stats=False):
    """Final hidden states x_BTD. segment_ids_BT: 0 marks padding (an attention mask)."""
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones(tokens_BT.shape, jnp.int32)
    x_BTD = self.embed(tokens_BT, positions_BT, type_ids_BT)
    bias_fn = self.rel_bias.bias_fn() if self.cfg.position == "relative" else None
    x_BTD, stats = run_stack(self.blocks, self.cfg, x_BTD, positions_BT, segment_ids_BT,
                             causal=False, bias_fn=bias_fn)
    if hasattr(self, "final_norm"):
      x_BTD = self.final_norm(x_BTD)
    return (x_BTD, stats) if return_stats else x_BTD

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, type_ids_BT=None,
               return_stats=False):
    """Masked-LM logits_BTV (float32) from the (tied) unembedding: the training objective."""
    x_BTD, stats = self.encode(tokens_BT, positions_BT, segment_ids_BT, type_ids_BT,
                               return_stats=True)
    logits_BTV = self.unembed(x_BTD)
    return (logits_BTV, stats) if return_stats else logits_BTV

  def embed_sentences(self, tokens_BT, mask_BT, type_ids_BT=None) -> jax.Array:
    """Pooled (cfg.pooling), L2-normalised sentence embeddings emb_BD in float32."""
    x_BTD = self.encode(tokens_BT, segment_ids_BT=mask_BT.astype(jnp.int32),
                        type_ids_BT=type_ids_BT)
    return normalize(pool(x_BTD, mask_BT, self.cfg.pooling))

  def classify(self, tokens_BT, mask_BT, type_ids_BT=None) -> jax.Array:
    """Class logits_BC (float32) from the pooled hidden state."""
    if not self.cfg.num_classes:
      raise ValueError("this encoder has no classification head: set model.num_classes > 0")
    x_BTD = self.encode(tokens_BT, segment_ids_BT=mask_BT.astype(jnp.int32),
                        type_ids_BT=type_ids_BT)
    x_BD = pool(x_BTD, mask_BT, self.cfg.pooling)
    logits_BC = x_BD @ self.classifier_DC[...].astype(jnp.float32) + self.classifier_C[...]
    return constrain(logits_BC, ("act_batch", None))
