"""The pretraining loop: config -> tokenizer, data, sharded state -> steps, evals, checkpoints.

Started again with the same config and workdir, it resumes from the newest
checkpoint: parameters, optimizer, step, RNG and the data iterator's position.
"""

import itertools
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

import parallel
from experiments.defaults import model_config_from
from models import ConfigError, ModelConfig, Tokenizer
from train import data as data_lib
from train import flops as flops_lib
from train import workdir as workdir_lib
from train.checkpoint import Checkpointer
from train.metrics import MetricsWriter
from train.optimizer import make_optimizer
from train.state import create_train_state
from train.step import jit_eval_step, jit_train_step


def validate(config: ConfigDict) -> None:
  """Checks the loop's own keys; ModelConfig checks the model's."""
  for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every",
              "eval_batches", "checkpoint_every", "keep_checkpoints"):
    if int(config[key]) <= 0:
      raise ConfigError(f"config.{key} must be positive, got {config[key]}")
  model_config_from(config)  # raises ConfigError naming the bad model key
  for key in ("init_from", "tokenizer.path"):
    path = config.init_from if key == "init_from" else config.tokenizer.path
    if path and not os.path.exists(path):
      raise FileNotFoundError(f"config.{key}: checkpoint path {path} does not exist")
  per_process = config.batch_size // jax.process_count()
  if config.batch_size % jax.process_count() or per_process % config.grad_accum:
    raise ConfigError(f"config.batch_size={config.batch_size} must split evenly over "
                      f"{jax.process_count()} process(es) x grad_accum={config.grad_accum}")


def resolve_tokenizer(config: ConfigDict, workdir: str) -> Tokenizer:
  """Resume: the workdir's. Else tokenizer.path, init_from, or a BPE trained on the data."""
  if os.path.isdir(os.path.join(workdir, "tokenizer")):
    return workdir_lib.load_tokenizer(workdir)
  path = config.tokenizer.path or config.init_from
  if path:
    if workdir_lib.is_workdir(path):
      return workdir_lib.load_tokenizer(path)
    from models import load_pretrained_tokenizer
    return load_pretrained_tokenizer(path)
  if config.tokenizer.train_vocab_size > 0:
    from train.tokenizer_training import train_bpe_tokenizer
    return train_bpe_tokenizer(data_lib.load_split(config.data, "train"),
                               config.tokenizer.train_vocab_size)
  raise ConfigError("no tokenizer: set tokenizer.path, init_from or tokenizer.train_vocab_size")


def resolve_model_config(config: ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
  model_cfg = model_config_from(config)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but "
                      f"model.vocab_size={model_cfg.vocab_size}")
  if model_cfg.bos_id is None and model_cfg.eos_id is None:
    values = dict(model_cfg.to_dict(), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    model_cfg = ModelConfig.from_mapping(values)
  return model_cfg


def _initial_params(config: ConfigDict, model_cfg: ModelConfig):
  if not config.init_from:
    return model_cfg, None
  if workdir_lib.is_workdir(config.init_from):
    model, _, _ = workdir_lib.load_trained(config.init_from)
  else:
    from models import load_pretrained
    model, _ = load_pretrained(config.init_from)
  from flax import nnx
  return model.cfg, nnx.state(model, nnx.Param)


def evaluate(eval_fn, params, val_ds, batch_sharding, num_batches: int) -> float:
  """Mean per-token loss over the first `num_batches` validation batches."""
  total, count = 0.0, 0.0
  for batch in itertools.islice(iter(val_ds), num_batches):
    loss_sum, n = eval_fn(params, _to_global(batch, batch_sharding))
    total, count = total + float(loss_sum), count + float(n)
  return total / max(count, 1.0)


def _to_global(batch, sharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def train(config: ConfigDict, workdir: str, stop_at: int | None = None) -> dict:
  """Runs (or resumes) training; returns the last logged metrics.

  `stop_at` ends this invocation early, after checkpointing that step, as a
  preemption would; the schedule still spans `config.steps`.
  """
  validate(config)
  workdir = os.path.abspath(workdir)
  mesh = parallel.make_mesh(config.mesh.to_dict())
  layout = parallel.get_layout(config.sharding)
  tokenizer = resolve_tokenizer(config, workdir)
  model_cfg = resolve_model_config(config, tokenizer)
  model_cfg, init_params = _initial_params(config, model_cfg)
  pipeline = parallel.pipeline_from_config(config.pipeline, dict(mesh.shape), config.sharding,
                                           model_cfg.num_layers,
                                           config.batch_size // config.grad_accum)
  workdir_lib.save_metadata(workdir, model_cfg, tokenizer)

  datasets = {split: data_lib.make_global_dataset(
      config.data, tokenizer, seq_len=config.seq_len, global_batch_size=config.batch_size,
      split=split, seed=config.seed, num_shards=config.data.num_shards)
      for split in ("train", "validation")}
  train_ds, val_ds = datasets["train"], datasets["validation"]
  train_iter = iter(train_ds)

  tx, schedule = make_optimizer(config.optimizer, config.steps)
  with parallel.axis_rules(layout.rules):
    graphdef, state, shardings = create_train_state(model_cfg, tx, mesh, config.seed, layout,
                                                    params=init_params)
    batch_sharding = NamedSharding(mesh, parallel.logical_to_spec(parallel.BATCH_AXES, mesh=mesh))
    step_fn = jit_train_step(graphdef, tx, schedule, shardings, batch_sharding, config.grad_accum)
    eval_fn = jit_eval_step(graphdef, shardings["params"], batch_sharding)

  ckpt = Checkpointer(workdir, config.keep_checkpoints, config.async_checkpoints)
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(state, train_iter)
  start = int(state["step"])

  flops_per_token = flops_lib.train_flops_per_token(model_cfg, config.seq_len)
  peak, peak_source = flops_lib.peak_flops_per_device(model_cfg.jnp_dtype,
                                                      config.peak_flops_per_device)
  writer = MetricsWriter(workdir, config.steps, start)
  if jax.process_index() == 0:
    print(f"meshlm: {model_cfg.num_params():,} params, "
          f"{jax.device_count()} device(s) in {jax.process_count()} process(es), "
          f"mesh {dict(mesh.shape)}, MFU peak {peak / 1e9:.1f} GFLOP/s per device ({peak_source}); "
          f"starting at step {start}/{config.steps}", flush=True)

  last = {}
  window_start, window_tokens = None, 0.0
  with (parallel.axis_rules(layout.rules), jax.set_mesh(mesh),
        parallel.pipeline_schedule(pipeline)):
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    for step in range(start, end):
      batch = _to_global(next(train_iter), batch_sharding)
      state, metrics = step_fn(state, batch)
      if window_start is None:  # the first step includes compilation: not timed
        jax.block_until_ready(metrics)
        window_start = time.perf_counter()
      else:
        window_tokens += config.batch_size * config.seq_len
      done = step + 1
      writer.advance()
      if done % config.log_every == 0 or done == config.steps:
        last = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed = time.perf_counter() - window_start
        if window_tokens:
          last["tokens_per_s"] = window_tokens / elapsed
          last["mfu"] = last["tokens_per_s"] * flops_per_token / (peak * jax.device_count())
        if done % config.eval_every == 0 or done == config.steps:
          last["val_loss"] = evaluate(eval_fn, state["params"], val_ds, batch_sharding,
                                      config.eval_batches)
        writer.write(done, last)
        window_start, window_tokens = time.perf_counter(), 0.0
      if done % config.checkpoint_every == 0 or done == end:
        ckpt.save(done, state, train_iter, force=True)
  ckpt.close()
  writer.close()
  return last
