"""MoE layer: routing, the dropless and capacity paths, router losses, balancing bias, errors."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallel
from conftest import EIGHT_DEVICES, REPO, tiny_config
from models import ConfigError, ModelConfig, Transformer
from models import moe, moe_dispatch
from train.loop import train
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_train_step

CFG = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=24,
           num_experts=4, top_k=2)


def _tokens(b=3, t=10, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG["vocab_size"], (b, t)), jnp.int32)


def _logits_and_grads(**kw):
  model = Transformer(ModelConfig(**{**CFG, **kw}), nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = _tokens()

  def loss(p):
    logits, stats = nnx.merge(graphdef, p)(tokens, return_stats=True)
    return jnp.mean(logits ** 2) + jnp.mean(stats["aux_loss"]), (logits, stats)

  (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, grads, stats


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_and_capacity_agree_when_nothing_is_dropped(top_k):
  """Same params, same tokens: the two paths differ only in float summation order."""
  ref_logits, ref_grads, ref_stats = _logits_and_grads(top_k=top_k, moe_impl="dropless",
                                                       grouped_matmul="tiled")
  for kw in (dict(moe_impl="dropless", grouped_matmul="ragged_dot"),
             dict(moe_impl="capacity", capacity_factor=float(CFG["num_experts"]))):
    logits, grads, stats = _logits_and_grads(top_k=top_k, **kw)
    assert float(jnp.sum(stats["dropped"])) == 0
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _numpy_gshard_keep(expert_BTK, num_experts, cap):
  """Reference priority: all first choices in token order, then all second choices, ..."""
  b, t, k = expert_BTK.shape
  keep = np.zeros((b, t, k), bool)
  for row in range(b):
    used = np.zeros(num_experts, int)
    for choice in range(k):
      for tok in range(t):
        e = expert_BTK[row, tok, choice]
        keep[row, tok, choice] = used[e] < cap
        used[e] += 1
  return keep


def test_capacity_path_drops_overflow_in_gshard_order_and_counts_it():
  rng = np.random.default_rng(1)
  b, t, d, e, k, f = 2, 16, 8, 4, 2, 6
  x_BTD = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  # Skewed routing: expert 0 is wanted by most tokens.
  expert_BTK = np.stack([np.where(rng.random((b, t)) < 0.7, 0, rng.integers(1, e, (b, t))),
                         rng.integers(1, e, (b, t))], -1)
  expert_BTK[..., 1] = np.where(expert_BTK[..., 1] == expert_BTK[..., 0],
                                (expert_BTK[..., 0] + 1) % e, expert_BTK[..., 1])
  weight_BTK = jnp.full((b, t, k), 0.5)
  w = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) / 3
            for s in ((e, d, f), (e, d, f), (e, f, d)))
  factor = 1.0
  cap = moe_dispatch.capacity(t, k, e, factor)
  assert cap == math.ceil(math.ceil(t * k / e) * factor) == 8
  out_BTD, dropped_BTK = moe_dispatch.capacity_dispatch(x_BTD, jnp.asarray(expert_BTK),
                                                        weight_BTK, w, e, factor)
  keep = _numpy_gshard_keep(expert_BTK, e, cap)
  np.testing.assert_array_equal(~np.asarray(dropped_BTK), keep)
  assert 0 < np.sum(~keep) < keep.size
  # What is kept is computed exactly as the dropless path computes it; dropped choices add 0.
  full = moe_dispatch.dropless(x_BTD, jnp.asarray(expert_BTK), weight_BTK * keep, w, "tiled")
  np.testing.assert_allclose(out_BTD, full, rtol=1e-5, atol=1e-6)


def test_router_gating_and_losses_match_closed_forms():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((2, 5, 6)).astype(np.float32) * 2
  mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, -1, kind="stable")[..., :3]
  chosen = np.take_along_axis(p, top, -1)
  for norm, want in (("topk", chosen / chosen.sum(-1, keepdims=True)), ("all", chosen)):
    expert, weight, _ = moe.route(jnp.asarray(logits), None, 3, norm)
    np.testing.assert_array_equal(expert, top)
    np.testing.assert_allclose(weight, want, rtol=1e-6)
  expert, _, probs = moe.route(jnp.asarray(logits), None, 3, "topk")
  stats = moe.router_stats(jnp.asarray(logits), probs, expert, jnp.zeros(expert.shape, bool),
                           jnp.asarray(mask))
  n = mask.sum()
  load = np.zeros(6)
  for e in top[mask].ravel():
    load[e] += 1
  np.testing.assert_allclose(stats["load"], load)
  aux = 6 * np.sum(load / (n * 3) * p[mask].mean(0))
  np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(stats["z_loss"], np.mean(lse[mask] ** 2), rtol=1e-5)
  ent = -np.sum(p * np.log(p), -1)
  np.testing.assert_allclose(stats["entropy"], np.mean(ent[mask]), rtol=1e-5)
  # Uniform routing scores exactly 1 (the loss is normalised per choice).
  uniform = moe.router_stats(jnp.zeros((1, 8, 4)), jnp.full((1, 8, 4), 0.25),
                             jnp.asarray(np.arange(16).reshape(1, 8, 2) % 4),
                             jnp.zeros((1, 8, 2), bool), jnp.ones((1, 8), bool))
  np.testing.assert_allclose(uniform["aux_loss"], 1.0, rtol=1e-6)


def test_router_computes_in_float32_under_bfloat16():
  model = Transformer(ModelConfig(**CFG, dtype="bfloat16", param_dtype="bfloat16"), nnx.Rngs(0))
  jaxpr = str(jax.make_jaxpr(lambda t: model(t, return_stats=True))(_tokens()))
  assert "f32[3,10,4]" in jaxpr  # router logits [B, T, E] in float32
  _, stats = model(_tokens(), return_stats=True)
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(stats))


def _train_steps(steps=8, **kw):
  cfg = ModelConfig(**{**CFG, **kw})
  config = tiny_config()
  tx, schedule = make_optimizer(config.optimizer, 20)
  mesh = parallel.make_mesh({"data": -1}, devices=jax.devices()[:1])
  graphdef, state, shardings = create_train_state(cfg, tx, mesh, seed=0)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = jit_train_step(graphdef, tx, schedule, shardings, rep)
  tokens = np.asarray(_tokens(4, 17, seed=3))
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones((4, 16), np.int32),
               positions=np.tile(np.arange(16, dtype=np.int32), (4, 1)))
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  return state, history


def test_auxiliary_loss_free_bias_moves_against_the_load_and_gets_no_gradient():
  rate = 0.05
  state, history = _train_steps(steps=3, router_bias_rate=rate, aux_loss_weight=0.0)
  bias = np.asarray(state["params"]["blocks"]["mlp"]["router_bias_E"][...])
  # Each step moves every bias by exactly +-rate (or 0): a sign rule, not an optimizer.
  assert np.allclose(np.round(bias / rate), bias / rate, atol=1e-4)
  assert np.any(bias != 0) and np.all(np.abs(bias) <= 3 * rate + 1e-6)
  # The router's top-k uses the bias, the weights do not: no gradient reaches it.
  graphdef, params = nnx.split(Transformer(ModelConfig(**CFG, router_bias_rate=rate),
                                           nnx.Rngs(0)), nnx.Param)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(_tokens()) ** 2))(params)
  assert not np.any(np.asarray(grads["blocks"]["mlp"]["router_bias_E"][...]))


def test_router_losses_are_added_to_the_training_loss_and_logged():
  _, with_aux = _train_steps(steps=1, aux_loss_weight=0.5, z_loss_weight=0.1)
  m = with_aux[0]
  for key in ("moe/aux_loss", "moe/z_loss", "moe/router_entropy", "moe/drop_rate",
              "moe/load_max_over_mean", "moe/load_e0", "moe/load_e3"):
    assert key in m, key
  assert abs(sum(m[f"moe/load_e{e}"] for e in range(4)) - 1) < 1e-5
  # `loss` is the language-model loss; the router losses change the gradient only.
  _, without = _train_steps(steps=1, aux_loss_weight=0.0, z_loss_weight=0.0)
  assert m["loss"] == pytest.approx(without[0]["loss"], rel=1e-6)
  assert m["grad_norm"] != pytest.approx(without[0]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("kw, message", [
    (dict(top_k=5), "model.top_k=5 > model.num_experts=4"),
    (dict(moe_impl="capacity", capacity_factor=0.0),
     "model.capacity_factor=0.0 must be > 0 on the capacity path"),
    (dict(moe_impl="capacity", capacity_factor=-1.0), "model.capacity_factor=-1.0"),
    (dict(moe_impl="sparse"), "model.moe_impl='sparse'"),
    (dict(router_norm="sigmoid"), "model.router_norm='sigmoid'"),
])
def test_bad_moe_configs_name_the_values(kw, message):
  with pytest.raises(ConfigError, match=message):
    ModelConfig(**{**CFG, **kw})


def test_experts_not_divisible_by_the_expert_axis_fails_before_any_work(tmp_path):
  import subprocess
  import sys
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "cli.main", "train", "--config",
         os.path.join(REPO, "experiments", "moe_shakespeare.py"), "--workdir", str(workdir),
         "--config.model.num_experts=6", "--config.mesh.expert=4", "--config.mesh.data=2",
         "--config.sharding=expert", "--config.tokenizer.train_vocab_size=300"]
  out = subprocess.run(cmd, env=EIGHT_DEVICES, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
  assert out.returncode != 0
  assert ("model.num_experts=6 is not divisible by the expert-parallel mesh axes ('expert',) "
          "of total size 4") in out.stderr, out.stderr[-2000:]
  assert not workdir.exists()


def test_moe_training_run_logs_router_metrics(tmp_path, shakespeare_slice):
  config = tiny_config(steps=4, **{"data.path": shakespeare_slice, "model.num_experts": 4,
                                   "model.top_k": 2, "model.moe_impl": "capacity",
                                   "model.capacity_factor": 1.0})
  train(config, str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert records and all("moe/load_max_over_mean" in r and "moe/drop_rate" in r for r in records)
  assert all(r["moe/load_max_over_mean"] >= 1.0 for r in records)
  assert {"moe/aux_loss", "moe/drop_rate", "moe/router_entropy"} <= _tensorboard_tags(
      tmp_path / "tensorboard")


def _tensorboard_tags(directory) -> set:
  """Scalar tags in TFRecord event files: [u64 length, u32 crc, Event proto, u32 crc]*."""
  import struct
  from tensorboardX.proto import event_pb2
  tags = set()
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      tags |= {v.tag for v in event.summary.value}
      pos += 12 + length + 4
  return tags


def test_router_stats_come_through_a_pipeline_unchanged():
  """Per-layer stats of a circular pipeline equal the sequential ones (one device, no mesh).

  Each microbatch's stats are averaged: counts scale by 1/M, token means stay,
  and the balancing loss becomes the mean of per-microbatch losses (it is a
  product of two means, as with gradient accumulation).
  """
  cfg = ModelConfig(**{**CFG, "num_layers": 4})
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  tokens = _tokens(4, 8)

  def run():
    def loss(p):
      logits, stats = nnx.merge(graphdef, p)(tokens, return_stats=True)
      return jnp.mean(logits ** 2), stats
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (ref_loss, ref_stats), ref_grads = run()
  with parallel.pipeline_schedule(parallel.PipelineConfig(2, 2, 2, "circular")):
    (loss, stats), grads = run()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(stats["load"] * 2, ref_stats["load"], rtol=1e-6)
  for key in ("z_loss", "entropy"):
    np.testing.assert_allclose(stats[key], ref_stats[key], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_tiled_grouped_matmul_in_chunks_equals_all_at_once(monkeypatch):
  """Large experts run the tiles in chunks (bounded memory); results must not change."""
  rng = np.random.default_rng(4)
  x_XD = jnp.asarray(rng.standard_normal((90, 8)), jnp.float32)
  w = tuple(jnp.asarray(rng.standard_normal(s) / 3, jnp.float32)
            for s in ((4, 8, 12), (4, 8, 12), (4, 12, 8)))
  group_A = jnp.asarray(rng.integers(0, 4, 90))
  args = (x_XD, jnp.arange(90), group_A, jnp.ones(90, bool), w, "tiled")
  whole = moe_dispatch.grouped_swiglu(*args)
  monkeypatch.setattr(moe_dispatch, "_TILE_WEIGHT_BYTES", 1)  # one tile per chunk
  np.testing.assert_array_equal(moe_dispatch.grouped_swiglu(*args), whole)
  np.testing.assert_allclose(moe_dispatch.grouped_swiglu(*args[:-1], "ragged_dot"), whole,
                             rtol=1e-5, atol=1e-6)


def test_shared_expert_adds_a_dense_swiglu_every_token_goes_through():
  cfg = ModelConfig(**CFG, shared_mlp_dim=16)
  layer = moe.MoE(cfg, nnx.Rngs(0))
  x_BTD = jax.random.normal(jax.random.key(1), (2, 6, CFG["d_model"]))
  out_BTD, _ = layer(x_BTD)
  routed_only = moe.MoE(ModelConfig(**CFG), nnx.Rngs(0))
  for name in ("router_DE", "gate_EDF", "up_EDF", "down_EFD"):
    getattr(routed_only, name)[...] = getattr(layer, name)[...]
  routed_BTD, _ = routed_only(x_BTD)
  np.testing.assert_allclose(out_BTD, routed_BTD + layer.shared(x_BTD), rtol=1e-6, atol=1e-7)
  assert cfg.num_params(active=True) - ModelConfig(**CFG).num_params(active=True) == (
      CFG["num_layers"] * 3 * CFG["d_model"] * 16)


def test_padding_takes_no_capacity_and_changes_nothing_for_real_tokens():
  """Real tokens alone vs the same tokens followed by padding that all wants one expert."""
  cfg = ModelConfig(**CFG, moe_impl="capacity", capacity_factor=1.0)
  layer = moe.MoE(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(5)
  real_BTD = jnp.asarray(rng.standard_normal((2, 8, CFG["d_model"])), jnp.float32)
  pad_BTD = jnp.broadcast_to(real_BTD[:, :1], (2, 8, CFG["d_model"]))  # copies of token 0
  x_BTD = jnp.concatenate([real_BTD, pad_BTD], axis=1)
  seg_BT = jnp.concatenate([jnp.ones((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32)], axis=1)
  # Capacity is sized from the padded length, so give the real-only run the same slots.
  expert_BTO, weight_BTO, _ = moe.route(
      jnp.einsum("BTD,DE->BTE", x_BTD, layer.router_DE[...]), None, 2, "topk")
  w = (layer.gate_EDF[...], layer.up_EDF[...], layer.down_EFD[...])
  with_pad, dropped = moe_dispatch.capacity_dispatch(x_BTD, expert_BTO, weight_BTO, w, 4, 0.5,
                                                     mask_BT=seg_BT > 0)
  alone, dropped_alone = moe_dispatch.capacity_dispatch(
      real_BTD, expert_BTO[:, :8], weight_BTO[:, :8], w, 4, 1.0)
  assert moe_dispatch.capacity(16, 2, 4, 0.5) == moe_dispatch.capacity(8, 2, 4, 1.0)
  np.testing.assert_array_equal(dropped[:, :8], dropped_alone)
  assert not np.any(dropped[:, 8:])  # padding is neither kept nor counted as dropped
  np.testing.assert_allclose(with_pad[:, :8], alone, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(with_pad[:, 8:], 0)


def test_balancing_bias_raises_underloaded_and_lowers_overloaded_experts():
  from train.moe_metrics import update_router_bias
  cfg = ModelConfig(**CFG, router_bias_rate=0.1)
  params = {"router_bias_E": jnp.zeros((2, 4)), "other": jnp.ones(3)}
  new = {"router_bias_E": jnp.full((2, 4), 7.0), "other": jnp.full(3, 2.0)}  # the optimizer's
  stats = {"load": jnp.asarray([[10.0, 30.0, 20.0, 20.0], [20.0, 20.0, 20.0, 20.0]])}
  out = update_router_bias(cfg, new, params, stats)
  np.testing.assert_allclose(out["router_bias_E"], [[0.1, -0.1, 0.0, 0.0], [0.0] * 4])
  np.testing.assert_array_equal(out["other"], new["other"])
