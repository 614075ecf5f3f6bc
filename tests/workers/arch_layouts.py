"""Worker: the encoder, encoder-decoder and prefix-LM trained 10 steps on 1 device and per layout.

Run in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8.
argv: OUT.json LAYOUT:MESH [...], MESH like data=2,tensor=4.
For each architecture in MODELS it trains the tiny model on one device, then
from the same initial parameters under every layout through the real train
state and step (train/state.py, train/step.py), and records losses, the
largest relative parameter difference against one device and every
parameter's PartitionSpec, so the test can check that the layout really split
the weights. It also records the gradient norms of
the encoder's attention biases ("bias_gradients"): BERT's key bias cannot change
the loss, so its gradient is rounding noise, which AdamW scales up to steps as
large as any other; the test does not compare that parameter.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import parallel
from layouts import OPT, STEPS, _spec
from models import ModelConfig
from train.optimizer import make_optimizer
from train.state import split_abstract_model, create_train_state
from train.step import forward_loss, jit_train_step

B, T, S = 8, 16, 24  # batch rows, decoder (or only) length, encoder length
# Vocabulary 64: every id occurs in every batch, so no embedding row gets a near-cancelling
# gradient that AdamW would blow up into a layout-dependent difference (tests/workers/layouts.py).
# Head counts divisible by tensor=4; d_model by fsdp=8.
MODELS = {
    # BERT: post-LayerNorm, erf GELU, biases, learned positions, token types, tied MLM head.
    "encoder": ModelConfig(
        arch="encoder", vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4,
        mlp_dim=128, norm="layer", norm_position="post", mlp_activation="gelu", use_bias=True,
        position="learned", type_vocab_size=2, max_seq_len=32, tie_embeddings=True,
        norm_eps=1e-12),
    # T5 v1.1: relative buckets, GEGLU, no 1/sqrt(H) scale, a deeper decoder, untied head.
    "encoder_decoder": ModelConfig(
        arch="encoder_decoder", vocab_size=64, d_model=64, num_layers=2, num_decoder_layers=3,
        num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=128, mlp_activation="geglu",
        position="relative", relative_buckets=8, relative_max_distance=16,
        attention_scale=1.0, tie_embeddings=False, norm_eps=1e-6),
    # Llama blocks with a bidirectional prompt; grouped-query attention (8 heads, 4 kv heads).
    "prefix_lm": ModelConfig(
        arch="prefix_lm", vocab_size=64, d_model=64, num_layers=2, num_heads=8, num_kv_heads=4,
        mlp_dim=128, tie_embeddings=False),
}


def _lengths(rng, n, full):
  """Real tokens per row: half the rows full, the rest padded at the end."""
  return np.where(np.arange(n) % 2 == 0, full, rng.integers(full // 2, full, n))


def _padding(lengths, length):
  return (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)


def _positions(n, length):
  return np.tile(np.arange(length, dtype=np.int32), (n, 1))


def encoder_batch(rng, vocab):
  """Masked LM: ~25% of the real tokens replaced by [MASK] (the last id); only those count."""
  mask_id = vocab - 1
  tokens = rng.integers(0, mask_id, (B, T)).astype(np.int32)
  seg = _padding(_lengths(rng, B, T), T)
  masked = (rng.random((B, T)) < 0.25) & (seg > 0)
  masked[:, 0] = True  # every row predicts something
  types = (np.arange(T)[None, :] >= T // 2).astype(np.int32).repeat(B, 0) * seg  # sentence A|B
  return dict(inputs=np.where(masked, mask_id, tokens).astype(np.int32), targets=tokens,
              segment_ids=seg, positions=_positions(B, T), loss_mask=masked.astype(np.int32),
              type_ids=types)


def encoder_decoder_batch(rng, vocab):
  """Source [B, S] and teacher-forced target [B, T], both with some end padding."""
  src = rng.integers(0, vocab, (B, S)).astype(np.int32)
  tgt = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
  enc_seg = _padding(_lengths(rng, B, S), S)
  dec_seg = _padding(_lengths(rng, B, T), T)
  return dict(inputs=tgt[:, :-1], targets=tgt[:, 1:], segment_ids=dec_seg,
              positions=_positions(B, T), enc_inputs=src * enc_seg, enc_segment_ids=enc_seg,
              enc_positions=_positions(B, S))


def prefix_lm_batch(rng, vocab):
  """A bidirectional prompt of 3..8 tokens per row; the loss covers the continuation only."""
  tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
  seg = _padding(_lengths(rng, B, T), T)
  prefix = (np.arange(T)[None, :] < rng.integers(3, 9, B)[:, None]).astype(np.int32)
  return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg,
              positions=_positions(B, T), prefix=prefix, loss_mask=1 - prefix)


BATCHES = {"encoder": encoder_batch, "encoder_decoder": encoder_decoder_batch,
           "prefix_lm": prefix_lm_batch}


def batches(arch: str):
  rng = np.random.default_rng(0)
  return [BATCHES[arch](rng, MODELS[arch].vocab_size) for _ in range(STEPS)]


def run(arch: str, layout_name: str, mesh, params=None):
  """(initial params, losses, params by path, param PartitionSpecs by path) after STEPS steps.

  `params`: start from these (placed by the layout's rules) instead of a fresh init.
  """
  model = MODELS[arch]
  layout = parallel.get_layout(layout_name)
  tx, schedule = make_optimizer(OPT, STEPS)
  with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
    graphdef, state, shardings = create_train_state(model, tx, mesh, seed=0, layout=layout,
                                                    params=params)
    initial = jax.tree.map(np.asarray, state["params"])  # the step donates the state
    # Every batch array is [B, T] or [B, S]: rows split over the data axes.
    batch_sharding = jax.sharding.NamedSharding(
        mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    data = [{k: jax.device_put(v, batch_sharding) for k, v in b.items()} for b in batches(arch)]
    step = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding).lower(
        state, data[0]).compile()
    losses = []
    for batch in data:
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  leaves = jax.tree_util.tree_leaves_with_path(state["params"])
  final = {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}
  specs = {jax.tree_util.keystr(p): _spec(x.sharding.spec) for p, x in leaves}
  return initial, losses, final, specs


def bias_gradients(params):
  """Gradient norms of the encoder's mean loss on one batch w.r.t. bq_NH, bk_KH and bv_KH.

  A key bias adds q.bk to every score of a query, which the softmax cancels, so
  its true gradient is zero; the query and value biases show a real gradient's size.
  """
  graphdef, _ = split_abstract_model(MODELS["encoder"])
  batch = batches("encoder")[0]
  names = ("bq_NH", "bk_KH", "bv_KH")

  @jax.jit
  def norms(params):
    grads = jax.grad(lambda p: forward_loss(graphdef, p, batch)[0] / batch["loss_mask"].sum())(
        params)
    return {name: jnp.linalg.norm(grads["blocks"]["attn"][name][...]) for name in names}

  return {name: float(v) for name, v in norms(params).items()}


def main():
  out_path, specs = sys.argv[1], sys.argv[2:]
  one = parallel.make_mesh({}, devices=jax.devices()[:1])
  results = {}
  for arch in MODELS:
    # Initialised once on one device; each layout places these with its own shardings
    # (create_train_state's path for pretrained weights), which saves a compile per layout.
    init, base_losses, base_params, _ = run(arch, "data_parallel", one)
    results[f"{arch}/single_device"] = {"losses": base_losses}
    if arch == "encoder":
      results["bias_gradients"] = bias_gradients(init)
    for spec in specs:
      name, mesh_spec = spec.split(":")
      sizes = {k: int(v) for k, v in (kv.split("=") for kv in mesh_spec.split(","))}
      _, losses, params, param_specs = run(arch, name, parallel.make_mesh(sizes), init)
      diffs = {k: float(np.max(np.abs(params[k] - v)) / (np.max(np.abs(v)) + 1e-12))
               for k, v in base_params.items()}
      results[f"{arch}/{spec}"] = {"losses": losses, "param_rel_diff": diffs,
                                   "param_specs": param_specs}
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
