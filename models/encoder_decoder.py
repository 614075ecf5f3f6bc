"""The encoder-decoder model (T5-style): one shared vocabulary, relative position buckets,
a bidirectional encoder stack, a causal decoder stack that cross-attends to it.

    logits_BTV = model(dec_inputs_BT, enc_inputs_BS=src_BS)      # teacher forcing
    enc_kv = model.cross_kv(model.encode(src_BS))                 # once per request
    logits, cache = model.decode(tokens_BT, ..., enc_kv=enc_kv)    # infer/seq2seq.py

Both stacks are the shared Blocks (models/blocks.py); the decoder's are built
with cross=True. With tied embeddings the decoder output is scaled by
d_model**-0.5 before the unembedding, as T5 does.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.blocks import decode_stack, make_stack, run_stack
from models.config import ModelConfig
from models.embedding import Embeddings
from models.layers import Norm
from models.positions import RelativePositionBias, default_positions


def _ones(ids):
  return jnp.ones(ids.shape, jnp.int32)


class EncoderDecoder(Embeddings):
  """(decoder tokens_BT, encoder enc_inputs_BS) -> decoder logits_BTV (float32)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    if cfg.arch != "encoder_decoder":
      raise ValueError(f"EncoderDecoder needs arch='encoder_decoder', got {cfg.arch!r}")
    self.cfg = cfg
    self._init_embeddings(cfg, rngs)
    if cfg.position == "relative":
      self.enc_rel_bias = RelativePositionBias(cfg, rngs, bidirectional=True)
      self.dec_rel_bias = RelativePositionBias(cfg, rngs, bidirectional=False)
    self.enc_blocks = make_stack(cfg, rngs, cfg.num_layers)
    if cfg.norm_position == "pre":  # post-norm blocks end normalised already
      self.enc_norm = Norm(cfg)
    self.blocks = make_stack(cfg, rngs, cfg.decoder_layers, cross=True)
    if cfg.norm_position == "pre":
      self.final_norm = Norm(cfg)
    self._init_unembed(cfg, rngs)

  def encode(self, enc_inputs_BS, enc_positions_BS=None, enc_segment_ids_BS=None):
    """Encoder output enc_BSD. enc_segment_ids_BS: 0 marks padding (never attended)."""
    cfg = self.cfg
    if enc_positions_BS is None:
      enc_positions_BS = default_positions(enc_inputs_BS)
    if enc_segment_ids_BS is None:
      enc_segment_ids_BS = _ones(enc_inputs_BS)
    x_BSD = self.embed(enc_inputs_BS, enc_positions_BS)
    x_BSD, _ = run_stack(self.enc_blocks, cfg, x_BSD, enc_positions_BS, enc_segment_ids_BS,
                         causal=False, bias_fn=self._bias_fn("enc_rel_bias"))
    return self.enc_norm(x_BSD) if cfg.norm_position == "pre" else x_BSD

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, enc_inputs_BS,
               enc_positions_BS=None, enc_segment_ids_BS=None, return_stats=False):
    """Teacher-forced decoder logits. Packed rows: a decoder token attends to the encoder
    tokens of its own segment id (so both sides number their examples alike)."""
    cfg = self.cfg
    self.check_inputs(tokens_BT, enc_inputs_BS)
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT)
    if segment_ids_BT is None:
      segment_ids_BT = _ones(tokens_BT)
    if enc_segment_ids_BS is None:
      enc_segment_ids_BS = _ones(enc_inputs_BS)
    enc_BSD = self.encode(enc_inputs_BS, enc_positions_BS, enc_segment_ids_BS)
    x_BTD = self.embed(tokens_BT, positions_BT)
    x_BTD, stats = run_stack(self.blocks, cfg, x_BTD, positions_BT, segment_ids_BT, None,
                             enc_BSD, enc_segment_ids_BS, causal=True,
                             bias_fn=self._bias_fn("dec_rel_bias"))
    logits_BTV = self.logits(x_BTD)
    return (logits_BTV, stats) if return_stats else logits_BTV

  def cross_kv(self, enc_BSD):
    """Every decoder layer's cross-attention keys and values of enc_BSD: (k_LBSKH, v_LBSKH),
    computed once per request rather than once per generated token."""
    graphdef, state = nnx.split(self.blocks)
    return jax.lax.map(lambda s: nnx.merge(graphdef, s).cross_attn.cross_kv(enc_BSD), state)

  def decode(self, tokens_BT, positions_BT, segment_ids_BT, layers_cache, cache, last_B=None, *,
             enc_kv, enc_segment_ids_BS):
    """Cached decoder step (see Transformer.decode) over `enc_kv = cross_kv(encode(...))`."""
    x_BTD = self.embed(tokens_BT, positions_BT)
    x_BTD, layers_cache = decode_stack(self.blocks, x_BTD, positions_BT, segment_ids_BT,
                                       layers_cache, cache, per_layer={"enc_kv": enc_kv},
                                       bias_fn=self._bias_fn("dec_rel_bias"),
                                       enc_segment_ids_BS=enc_segment_ids_BS)
    if last_B is None:
      return self.logits(x_BTD), layers_cache
    x_B1D = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)
    return self.logits(x_B1D)[:, 0], layers_cache

  def check_inputs(self, tokens_BT, enc_inputs_BS):
    if tokens_BT.shape[0] != enc_inputs_BS.shape[0]:
      raise ValueError(f"decoder batch {tokens_BT.shape[0]} != encoder batch "
                       f"{enc_inputs_BS.shape[0]}: each row pairs a target with its source")

  def _bias_fn(self, name):
    return getattr(self, name).bias_fn() if self.cfg.position == "relative" else None

  def logits(self, x_BTD):
    """logits_BTV (float32) of the last decoder block's output x_BTD: final norm, T5's
    d_model**-0.5 scale when tied, unembedding."""
    if self.cfg.norm_position == "pre":
      x_BTD = self.final_norm(x_BTD)
    if self.cfg.tie_embeddings:
      x_BTD = x_BTD * jnp.asarray(self.cfg.d_model ** -0.5, x_BTD.dtype)
    return self.unembed(x_BTD)
