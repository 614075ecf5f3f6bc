"""Everything a run needs before its first step, checked before anything is written."""

import dataclasses
import os

import jax
from ml_collections import ConfigDict

import parallel
from models import ConfigError, ModelConfig, Tokenizer, load_pretrained, load_pretrained_tokenizer
from train import data as data_lib
from train import workdir as workdir_lib
from train.defaults import model_config_from
from train.mlm_data import mask_id
from train.seq2seq_data import tokenizer_texts
from train.state import split_abstract_model
from train.tokenizer_training import train_bpe_tokenizer

ANOMALY_POLICIES = ("skip", "rollback")


def validate(config: ConfigDict) -> None:
  """Checks the loop's own keys; ModelConfig checks the model's."""
  for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every",
              "eval_batches", "checkpoint_every", "keep_checkpoints"):
    if int(config[key]) <= 0:
      raise ConfigError(f"config.{key} must be positive, got {config[key]}")
  check_task(config, model_config_from(config))  # raises ConfigError naming the bad key
  if not 0 < config.data.mlm.mask_prob < 1:
    raise ConfigError(f"config.data.mlm.mask_prob={config.data.mlm.mask_prob} must be in (0, 1)")
  if config.anomaly.policy not in ANOMALY_POLICIES:
    raise ConfigError(f"config.anomaly.policy={config.anomaly.policy!r}; "
                      f"choose one of {ANOMALY_POLICIES}")
  for key in ("init_from", "tokenizer.path"):
    path = config.init_from if key == "init_from" else config.tokenizer.path
    if path and not os.path.exists(path):
      raise FileNotFoundError(f"config.{key}: checkpoint path {path} does not exist")
  per_process = config.batch_size // jax.process_count()
  if config.batch_size % jax.process_count() or per_process % config.grad_accum:
    raise ConfigError(f"config.batch_size={config.batch_size} must split evenly over "
                      f"{jax.process_count()} process(es) x grad_accum={config.grad_accum}")


def check_task(config: ConfigDict, model_cfg: ModelConfig) -> None:
  """The data task suits the architecture, and learned positions cover every row."""
  task, arch = config.data.task, model_cfg.arch
  if task not in data_lib.TASKS:
    raise ConfigError(f"config.data.task={task!r}; choose one of {data_lib.TASKS}")
  needs = {"encoder_decoder": "seq2seq", "encoder": "mlm"}.get(arch)
  if needs and task != needs:
    raise ConfigError(f"model.arch={arch!r} trains with data.task={needs!r}, not {task!r}")
  if task == "mlm" and arch != "encoder":
    raise ConfigError(f"data.task='mlm' (masked-LM) trains encoders (model.arch='encoder'), not "
                      f"arch={arch!r}: a causal model cannot attend to the tokens it predicts")
  if model_cfg.position == "learned":
    longest = max(int(config.seq_len),
                  int(config.data.seq2seq.source_len) if arch == "encoder_decoder" else 0)
    if longest > model_cfg.max_seq_len:
      raise ConfigError(f"rows of {longest} tokens (seq_len / data.seq2seq.source_len) exceed "
                        f"model.max_seq_len={model_cfg.max_seq_len}, the learned position table")


def resolve_tokenizer(config: ConfigDict, workdir: str) -> Tokenizer:
  """Resume: the workdir's. Else tokenizer.path, init_from, or a BPE trained on the data."""
  if os.path.isdir(os.path.join(workdir, "tokenizer")):
    return workdir_lib.load_tokenizer(workdir)
  path = config.tokenizer.path or config.init_from
  if path:
    if workdir_lib.is_workdir(path):
      return workdir_lib.load_tokenizer(path)
    return load_pretrained_tokenizer(path)
  if config.tokenizer.train_vocab_size > 0:
    if config.data.task == "seq2seq":  # the task's own text: its sources and targets
      texts = tokenizer_texts(config.data)
    else:
      # Leniently: bad records are the task's to refuse (pretraining) or skip and count
      # (alignment, align/datasets.py), not the tokenizer's.
      texts = data_lib.load_split(config.data, "train", skip_bad=True)
    return train_bpe_tokenizer(texts, config.tokenizer.train_vocab_size)
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
    model, _ = load_pretrained(config.init_from)
  from flax import nnx
  return model.cfg, nnx.state(model, nnx.Param)


def param_shapes(model_cfg: ModelConfig) -> dict:
  """{parameter path: (shape, dtype)} of `model_cfg`'s model, from shapes alone."""
  _, params = split_abstract_model(model_cfg)
  return {jax.tree_util.keystr(path): (leaf.shape, str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def check_resume(workdir: str, model_cfg: ModelConfig) -> bool:
  """Whether `workdir` holds a run to resume; ConfigError, naming each changed key, where
  `model_cfg` gives its parameters other shapes than the run's own (model_config.json) does:
  its checkpoints could not be restored into them."""
  if not workdir_lib.is_workdir(workdir):
    return False
  try:
    stored = workdir_lib.load_model_config(workdir)
  except (OSError, ValueError, TypeError, KeyError) as e:
    raise ConfigError(f"{workdir}/{workdir_lib.MODEL_CONFIG} is unreadable ({e}); resume "
                      "needs it: restore it, or train in a new --workdir") from None
  if param_shapes(stored) == param_shapes(model_cfg):
    return True
  old, new = stored.to_dict(), model_cfg.to_dict()
  changed = [k for k in new if old.get(k) != new[k]]
  raise ConfigError(
      f"this run ({workdir}) has " + ", ".join(f"model.{k}={old.get(k)!r}" for k in changed)
      + "; you passed " + ", ".join(f"{new[k]!r}" for k in changed) + ": its checkpoints "
      "hold parameters of other shapes or types and cannot be resumed with these. Train in "
      "a new --workdir (config.init_from can start it from this run when the shapes agree)")


@dataclasses.dataclass
class Plan:
  """The resolved pieces of a run: mesh, layout, tokenizer, model config, pipeline."""
  mesh: jax.sharding.Mesh
  layout: parallel.Layout
  tokenizer: Tokenizer
  model_cfg: ModelConfig
  init_params: object
  pipeline: object
  resuming: bool = False  # the workdir holds a run: its metadata is rewritten after restore


def plan_run(config: ConfigDict, workdir: str, before_write=None) -> Plan:
  """Validates and resolves; raises before writing anything, then writes the workdir metadata
  of a new run (a resumed run's once its checkpoint has restored: `Plan.resuming`).
  `before_write(plan)` runs last before the write (a task loading and checking its data)."""
  validate(config)
  mesh = parallel.make_mesh(config.mesh.to_dict())
  layout = parallel.get_layout(config.sharding)
  tokenizer = resolve_tokenizer(config, workdir)
  # init_from brings its own model config (config.model is then not used).
  model_cfg = None if config.init_from else resolve_model_config(config, tokenizer)
  model_cfg, init_params = _initial_params(config, model_cfg)
  if tokenizer.vocab_size > model_cfg.vocab_size:  # e.g. tokenizer.path not init_from's
    raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the model "
                      f"({config.init_from or 'config.model'}) has vocab_size "
                      f"{model_cfg.vocab_size}")
  check_task(config, model_cfg)  # again: init_from may have brought another architecture
  if "float16" in (model_cfg.dtype, model_cfg.param_dtype):
    # float16's 5-bit exponent underflows small gradients; training in it needs dynamic loss
    # scaling, which meshlm does not do. bfloat16 has float32's range and needs none.
    raise ConfigError(f"model.dtype={model_cfg.dtype!r}, model.param_dtype="
                      f"{model_cfg.param_dtype!r}: training in float16 needs dynamic loss "
                      "scaling, which meshlm does not implement; train with "
                      "model.dtype='bfloat16' (float32 master weights and optimizer state) "
                      "and serve in float16 if you like")
  if config.data.task == "mlm":
    mask_id(tokenizer, model_cfg.vocab_size)  # raises, naming the fix, if no id fits
  pipeline = parallel.pipeline_from_config(config.pipeline, dict(mesh.shape), config.sharding,
                                           model_cfg.num_layers,
                                           config.batch_size // config.grad_accum)
  if model_cfg.is_moe:
    with parallel.axis_rules(layout.rules), jax.set_mesh(mesh):
      try:
        parallel.check_experts_divide(model_cfg.num_experts)
      except ValueError as e:
        raise ConfigError(f"{e} (mesh {dict(mesh.shape)}, sharding {config.sharding!r})") from None
  resuming = check_resume(workdir, model_cfg)
  plan = Plan(mesh, layout, tokenizer, model_cfg, init_params, pipeline, resuming)
  if before_write is not None:
    before_write(plan)
  if not resuming:
    workdir_lib.save_metadata(workdir, model_cfg, tokenizer)
  return plan
