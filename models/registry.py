"""One entry point for every architecture: `create_model(cfg, rngs)` picks the class by
`cfg.arch`; they all share Blocks, Attention, MLP, norms and embeddings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallel import logical_shardings

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


def abstract_model(cfg: ModelConfig):
  """The model `cfg.arch` names, its params ShapeDtypeStructs: shapes, dtypes, logical names.

  Built outside any ambient mesh: the logical names are mapped to mesh axes by
  `parallel/`, not by flax's eval_shape.
  """
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: create_model(cfg, nnx.Rngs(0)))


def param_count(cfg: ModelConfig) -> int:
  """Parameters of cfg's model, counted from its abstract shapes (no memory allocated)."""
  state = nnx.state(abstract_model(cfg), nnx.Param)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def build_from_params(cfg: ModelConfig, params_fn, mesh=None):
  """The model cfg.arch names, built abstractly and filled with `params_fn(abstract_params)`
  -> {param path: numpy array (or a value already on device)}.

  With `mesh`, each array is placed straight into its sharding from the params'
  logical axis names, so no single device ever holds the whole model.
  """
  model = abstract_model(cfg)
  state = nnx.state(model, nnx.Param)
  params = params_fn(state)
  shardings = None
  if mesh is not None:
    shardings = nnx.to_pure_dict(logical_shardings(state, mesh))
  pure = nnx.to_pure_dict(state)

  def place(path, _):
    keys = tuple(k.key for k in path)
    arr = params.pop(keys)  # drop host copies as we go
    if not isinstance(arr, np.ndarray):
      return arr  # supplied whole (e.g. quantized), already on device
    if shardings is None:
      return jnp.asarray(arr)
    sharding = shardings
    for k in keys:
      sharding = sharding[k]
    return jax.device_put(arr, sharding)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, pure))
  nnx.update(model, state)
  return model
