"""Quantized checkpoints: a directory that `meshlm generate --model DIR` loads.

  DIR/quant.json   model config, plan {param path: format name, e.g. "int4-g64"}, method,
                   source, calibration (and whatever else the caller records)
  DIR/tokenizer/   models.Tokenizer.save() (absent when the source had no tokenizer)
  DIR/params/      Orbax checkpoint of the parameter tree, QArray leaves included

Reloading builds the abstract model from the config, puts abstract QArrays
(ShapeDtypeStructs shaped by the plan) where the plan says, and restores into
that target, so no float copy of a quantized weight is ever made.
"""

import json
import math
import os
import shutil
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from models import ModelConfig, Tokenizer
from models.quant.formats import QuantFormat, check_group, parse_format
from models.quant.qarray import QArray
from models.quant.rules import CONTRACTS, axes_of, contraction_size
from models.registry import abstract_model

QUANT_JSON = "quant.json"
# 2: float16 scales, unsigned codes, output-major embedding tables. Orbax would cast an
# older checkpoint's arrays to the new dtypes silently, so other versions are refused.
VERSION = 2


def is_quantized_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, QUANT_JSON))


def abstract_qarray(path: str, shape, fmt: QuantFormat) -> QArray:
  """The QArray of ShapeDtypeStructs that quantizing a float param of `shape` with `fmt` gives."""
  name = path.rsplit("/", 1)[-1]
  if name not in CONTRACTS:
    raise ValueError(f"parameter {path!r} is not quantizable (quantizable: {', '.join(CONTRACTS)})")
  letters, in_letters = axes_of(path)
  shape = tuple(int(d) for d in shape)
  lead, dims = shape[:len(shape) - len(letters)], shape[len(shape) - len(letters):]
  k = contraction_size(path, shape)
  m = math.prod(dims) // k
  g = check_group(fmt, k, f"{path} (shape {shape})")
  rows = g // 2 if fmt.bits == 4 else g  # INT4 packs two rows per byte
  # Codes as formats.quantize_values makes them: unsigned, but W8A8's signed q.
  codes_dtype = np.int8 if fmt.signed_codes else np.uint8
  sds = jax.ShapeDtypeStruct
  codes_shape, scale_shape = (k // g, rows, m), (k // g, m)
  if letters[0] not in in_letters:   # output-major storage (QArray.out_first)
    codes_shape, scale_shape = (m, k // g, rows), (m, k // g)
  scale = sds(lead + scale_shape, np.float16)  # scales are stored as float16
  offset = None if fmt.symmetric else sds(lead + scale_shape,
                                          np.uint8 if fmt.int_zero else np.float16)
  return QArray(sds(lead + codes_shape, codes_dtype), scale, offset, fmt, letters, in_letters,
                dims)


def _shapes(tree):
  return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype).name), tree)


def _pure_params(model) -> tuple[nnx.GraphDef, nnx.State, dict]:
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params, nnx.to_pure_dict(params)


def _flat(pure: dict, prefix: str = "") -> dict:
  """{'a/b/c': leaf} of a nested dict whose leaves are arrays or QArrays."""
  out = {}
  for key, value in pure.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flat(value, path + "/"))
    else:
      out[path] = value
  return out


def quantized_params(model) -> dict[str, QArray]:
  """{param path: QArray} of the model's quantized weights ({} for a float model)."""
  return {p: v for p, v in _flat(_pure_params(model)[2]).items() if isinstance(v, QArray)}


def _check_plan(model, plan: dict) -> dict[str, str]:
  """{path: format name} after checking that the model's QArrays are exactly the plan's."""
  names = {p: f.name if isinstance(f, QuantFormat) else parse_format(f).name
           for p, f in plan.items()}
  quantized = quantized_params(model)
  missing = sorted(set(names) - set(quantized))
  extra = sorted(set(quantized) - set(names))
  if missing or extra:
    raise ValueError(f"plan and model disagree: plan entries not quantized in the model "
                     f"{missing}, quantized weights missing from the plan {extra}")
  for path, q in quantized.items():
    if q.fmt.name != names[path]:
      raise ValueError(f"{path}: plan says {names[path]}, the weight is {q.fmt.name}")
    # The reload target is built from the plan alone: it must match what is saved.
    full = tuple(q.codes.shape[:q.codes.ndim - 3]) + tuple(q.dims)
    want = abstract_qarray(path, full, q.fmt)
    if _shapes(want) != _shapes(q):
      raise ValueError(f"{path}: stored layout {_shapes(q)} differs from the layout a reload "
                       f"expects {_shapes(want)}")
  return dict(sorted(names.items()))


def save_quantized(model, tokenizer, out_dir: str, plan: dict, meta: dict | None = None) -> str:
  """Writes DIR atomically (a sibling temp dir, renamed when complete); returns DIR.

  `plan` is {path: QuantFormat or name} as quantize_model returns it; `meta`
  (method, source, calibration, ...) is recorded in quant.json as given.
  """
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise FileExistsError(f"output {out_dir} already exists and is not an empty directory; "
                          "remove it or choose another --out")
  names = _check_plan(model, plan)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
  try:
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make DIR private after the rename
    info = dict(version=VERSION, model_config=model.cfg.to_dict(), plan=names, **(meta or {}))
    with open(os.path.join(tmp, QUANT_JSON), "w") as f:
      json.dump(info, f, indent=1)
    if tokenizer is not None:
      tokenizer.save(os.path.join(tmp, "tokenizer"))
    _, _, pure = _pure_params(model)
    # Synchronous: an async save could still be creating files after a failure was raised.
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckpt:
      ckpt.save(os.path.join(tmp, "params"), args=ocp.args.StandardSave(pure))
    os.replace(tmp, out_dir)  # onto nothing or an empty directory: atomic
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def read_info(directory: str) -> dict:
  """quant.json of a quantized checkpoint, with its plan parsed to QuantFormats."""
  path = os.path.join(directory, QUANT_JSON)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} is not a quantized checkpoint (no {QUANT_JSON})")
  with open(path) as f:
    info = json.load(f)
  for key in ("model_config", "plan"):
    if key not in info:
      raise ValueError(f"{path} has no {key!r} entry")
  if info.get("version") != VERSION:
    raise ValueError(f"{path}: format version {info.get('version')!r}, this meshlm reads version "
                     f"{VERSION}; quantize the float model again with `meshlm quantize`")
  plan = {}
  for param, name in info["plan"].items():
    try:
      plan[param] = parse_format(name)
    except ValueError as e:
      raise ValueError(f"{path}: parameter {param}: {e}") from e
  info["plan"] = plan
  return info


def load_quantized(directory: str):
  """(model, tokenizer or None) from a directory save_quantized wrote."""

  info = read_info(directory)
  cfg = ModelConfig.from_mapping(info["model_config"])
  graphdef, abstract, pure = _pure_params(abstract_model(cfg))
  leaves = _flat(pure)
  unknown = sorted(set(info["plan"]) - set(leaves))
  if unknown:
    raise ValueError(f"{os.path.join(directory, QUANT_JSON)}: the plan names parameter(s) "
                     f"{unknown} that this model config does not have "
                     f"(it has: {', '.join(sorted(leaves))})")
  for path, fmt in info["plan"].items():
    *parents, leaf = path.split("/")
    node = pure
    for key in parents:
      node = node[key]
    node[leaf] = abstract_qarray(path, leaves[path].shape, fmt)
  # Plain shapes and dtypes: Orbax places the arrays on the default device.
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pure)
  params_dir = os.path.join(os.path.abspath(directory), "params")
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{directory} has no params/ checkpoint")
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckpt:
    restored = ckpt.restore(params_dir, args=ocp.args.StandardRestore(target))
  nnx.replace_by_pure_dict(abstract, restored)
  tok_dir = os.path.join(directory, "tokenizer")
  tokenizer = Tokenizer.load(tok_dir) if os.path.isdir(tok_dir) else None
  return nnx.merge(graphdef, abstract), tokenizer
