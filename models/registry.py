"""One entry point for every architecture: `create_model(cfg, rngs)` picks the class by
`cfg.arch`; they all share Blocks, Attention, MLP, norms and embeddings."""

import math

import jax
from flax import nnx

from models.config import ModelConfig
from models.encoder import Encoder
from models.encoder_decoder import EncoderDecoder
from models.transformer import Transformer

ARCH_CLASSES = {"decoder": Transformer, "prefix_lm": Transformer, "encoder": Encoder,
                "encoder_decoder": EncoderDecoder}

# What each architecture's forward takes besides (inputs, positions, segment_ids): the batch
# keys train/step.py passes on, and the keyword they become.
EXTRA_INPUTS = {
    "decoder": {},
    "prefix_lm": {"prefix": "prefix_BT"},
    "encoder": {"type_ids": "type_ids_BT"},
    "encoder_decoder": {"enc_inputs": "enc_inputs_BS", "enc_positions": "enc_positions_BS",
                        "enc_segment_ids": "enc_segment_ids_BS"},
}


def create_model(cfg: ModelConfig, rngs: nnx.Rngs | None = None):
  """A freshly initialised model of architecture `cfg.arch`."""
  return ARCH_CLASSES[cfg.arch](cfg, rngs if rngs is not None else nnx.Rngs(0))


def model_inputs(cfg: ModelConfig, batch) -> dict:
  """The keyword inputs of cfg.arch's forward that `batch` carries."""
  return {kw: batch[key] for key, kw in EXTRA_INPUTS[cfg.arch].items() if key in batch}


def param_count(cfg: ModelConfig) -> int:
  """Parameters of cfg's model, counted from its abstract shapes (no memory allocated)."""
  from models.transformer import abstract_model
  state = nnx.state(abstract_model(cfg), nnx.Param)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
