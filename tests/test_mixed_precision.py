"""Mixed precision: bfloat16 compute over float32 master weights and optimizer state
(`model.dtype='bfloat16'`, `model.param_dtype='float32'`) tracks float32 training on the
quickstart model; float16 training, which would need loss scaling, is refused."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallel
from conftest import tiny_config
from experiments.quickstart import get_config
from models import ConfigError, ModelConfig
from train.loop import train
from train.optimizer import make_optimizer
from train.state import create_train_state

STEPS = 20
# bfloat16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2% per operation); summed
# over a network's depth and 20 updates, the loss may drift by a few tenths of a percent.
# 2% of the float32 loss at every logged step, and of the validation loss, is the bar.
TOLERANCE = 0.02


def _quickstart(dtype: str, tmp_path) -> tuple[list[dict], dict]:
  config = get_config()  # the quickstart model: d_model 128, 4 layers, sequences of 128
  config.batch_size = 4  # of 16: bfloat16 matmuls are slow on CPU
  config.steps = STEPS
  config.log_every = 5
  config.eval_every = STEPS
  config.checkpoint_every = STEPS
  config.peak_flops_per_device = 1e11
  config.sample.max_new_tokens = 0
  config.model.dtype = dtype
  workdir = str(tmp_path / dtype)
  last = train(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = [m for m in map(json.loads, f) if "loss" in m]
  return logged, last


def test_bfloat16_compute_tracks_float32_on_the_quickstart_model(tmp_path):
  f32, f32_last = _quickstart("float32", tmp_path)
  bf16, bf16_last = _quickstart("bfloat16", tmp_path)
  assert [m["step"] for m in f32] == [m["step"] for m in bf16] == list(range(5, STEPS + 1, 5))
  for a, b in zip(f32, bf16):
    print(f"step {a['step']}: float32 {a['loss']:.4f} bfloat16 {b['loss']:.4f}")
    assert abs(b["loss"] - a["loss"]) <= TOLERANCE * a["loss"], (a, b)
  assert abs(bf16_last["val_loss"] - f32_last["val_loss"]) <= TOLERANCE * f32_last["val_loss"]
  assert f32[-1]["loss"] < f32[0]["loss"] - 0.5  # it trained: the comparison means something


def test_bfloat16_compute_keeps_float32_weights_and_optimizer_state():
  config = get_config()
  m = config.model
  cfg = ModelConfig(vocab_size=m.vocab_size, d_model=m.d_model, num_layers=2,
                    num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, mlp_dim=m.mlp_dim,
                    tie_embeddings=m.tie_embeddings, dtype="bfloat16", param_dtype="float32")
  tx, _ = make_optimizer(config.optimizer, 10)
  mesh = parallel.make_mesh({"data": -1}, devices=jax.devices()[:1])
  graphdef, state, _ = create_train_state(cfg, tx, mesh, seed=0)
  floats = [x for x in jax.tree.leaves((state["params"], state["opt_state"]))
            if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.float32 for x in floats)
  model = nnx.merge(graphdef, state["params"])
  jaxpr = str(jax.make_jaxpr(lambda t: model(t))(np.zeros((1, 8), np.int32)))
  assert "bf16" in jaxpr and "dot_general" in jaxpr  # the matmuls run in bfloat16


@pytest.mark.parametrize("key", ["model.dtype", "model.param_dtype"])
def test_float16_training_is_refused_before_anything_is_written(tmp_path, key):
  config = tiny_config(**{key: "float16"})
  with pytest.raises(ConfigError, match="training in float16 needs dynamic loss scaling"):
    train(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints")
