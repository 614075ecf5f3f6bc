"""What a training workdir holds besides checkpoints: the model config and the tokenizer.

  WORKDIR/model_config.json   ModelConfig as JSON
  WORKDIR/tokenizer/          models.Tokenizer.save()
  WORKDIR/checkpoints/        Orbax CheckpointManager (train/checkpoint.py)
"""

import json
import os
import tempfile

import jax
from flax import nnx

from models import ModelConfig, Tokenizer
from train.checkpoint import restore_params
from train.state import split_abstract_model

MODEL_CONFIG = "model_config.json"


def is_workdir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MODEL_CONFIG))


def save_metadata(workdir: str, model_cfg: ModelConfig, tokenizer: Tokenizer) -> None:
  """Writes both files atomically (temp file, then rename), from process 0 only."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  tok_dir = os.path.join(workdir, "tokenizer")
  if not os.path.isdir(tok_dir):
    staging = tempfile.mkdtemp(dir=workdir, prefix=".tokenizer-")
    tokenizer.save(staging)
    os.replace(staging, tok_dir)
  fd, tmp = tempfile.mkstemp(dir=workdir, prefix=".model_config-")
  with os.fdopen(fd, "w") as f:
    json.dump(model_cfg.to_dict(), f, indent=1)
  os.replace(tmp, os.path.join(workdir, MODEL_CONFIG))


def load_model_config(workdir: str) -> ModelConfig:
  with open(os.path.join(workdir, MODEL_CONFIG)) as f:
    return ModelConfig.from_mapping(json.load(f))


def load_tokenizer(workdir: str) -> Tokenizer:
  return Tokenizer.load(os.path.join(workdir, "tokenizer"))


MERGED = "merged"  # a LoRA run's base + adapters, as a plain workdir inside its own


def save_model(workdir: str, model_cfg: ModelConfig, tokenizer: Tokenizer, params,
               step: int) -> None:
  """A loadable workdir holding just `params` at `step` (no optimizer or data state)."""
  import orbax.checkpoint as ocp
  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  with ocp.CheckpointManager(directory, item_names=("state",),
                             options=ocp.CheckpointManagerOptions(create=True)) as manager:
    if step not in manager.all_steps():  # a finished run started again: already written
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave({"params": params})), force=True)
      manager.wait_until_finished()
  # Last: a directory is a loadable workdir only once its checkpoint is complete.
  save_metadata(workdir, model_cfg, tokenizer)


def load_trained(workdir: str, step: int | None = None):
  """(model, tokenizer, step) from the newest checkpoint of a training workdir (of a LoRA
  run: its merged model, WORKDIR/merged)."""

  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"workdir {workdir} does not exist")
  if not is_workdir(workdir):
    raise FileNotFoundError(f"{workdir} is not a meshlm workdir (no {MODEL_CONFIG})")
  if step is None and is_workdir(os.path.join(workdir, MERGED)):
    return load_trained(os.path.join(workdir, MERGED))
  model_cfg = load_model_config(workdir)
  graphdef, abstract_params = split_abstract_model(model_cfg)
  params, step = restore_params(workdir, abstract_params, step)
  return nnx.merge(graphdef, params), load_tokenizer(workdir), step
