"""A model in, a quantized checkpoint directory out: what `meshlm quantize` runs
(cli/quantize.py parses its flags).

The model is anything `meshlm generate` takes (workdir, HF directory, .gguf). Calibration
text (every method but rtn, and scale tuning) is a .txt file, or .json/.jsonl records
whose "instruction" + "output" (else "text") strings are used; `tune_epochs` then trains
the group scales toward the float model on it (infer/quant/tune.py).
"""

import json
import os
from collections import Counter

import numpy as np

from infer.loading import load_any
from models.quant import default_rules, parse_format
from infer.quant import quantize_model, weight_bytes
from infer.quant.awq import awq_quantize
from infer.quant.checkpoint import quantized_params, save_quantized
from infer.quant.gptq import gptq_quantize
from infer.quant.smooth import smooth_quantize
from infer.quant.tune import tune_scales
from train.report_paths import portable_path

METHODS = ("gptq", "awq", "awq-gptq", "smooth", "rtn")
EMBEDDINGS = {"auto": "auto", "same": "same", "int8": "int8", "none": None}


def _record_text(record) -> str | None:
  if isinstance(record, str):
    return record
  if not isinstance(record, dict):
    return None
  parts = [record.get(k) for k in ("instruction", "output")]
  parts = [p for p in parts if isinstance(p, str) and p]
  if parts:
    return "\n".join(parts)
  text = record.get("text")
  return text if isinstance(text, str) and text else None


def _calib_texts(path: str) -> list[str]:
  """The documents of a calibration file: the whole .txt, or one per JSON record."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"calibration file {path} does not exist")
  ext = os.path.splitext(path)[1].lower()
  with open(path, encoding="utf-8") as f:
    if ext == ".txt":
      return [f.read()]
    if ext == ".jsonl":
      records = [json.loads(line) for line in f if line.strip()]
    elif ext == ".json":
      records = json.load(f)
      records = records if isinstance(records, list) else [records]
    else:
      raise ValueError(f"calibration file {path}: use a .txt, .json or .jsonl file")
  texts = [t for t in map(_record_text, records) if t]
  if not texts:
    raise ValueError(f"calibration file {path}: no record has a string 'instruction'/'output' "
                     "or 'text' field")
  return texts


def calibration_ids(path: str, tokenizer, samples: int, length: int) -> np.ndarray:
  """int32 [N, T]: the file's tokens cut into T-token pieces, N of them spread over the file."""
  if samples < 1 or length < 1:
    raise ValueError(f"--calib_samples={samples} and --calib_len={length} must be >= 1")
  stream = []
  for text in _calib_texts(path):
    stream += tokenizer.encode(text)
    if tokenizer.eos_id is not None:
      stream.append(tokenizer.eos_id)  # documents stay apart, as in training
  available = len(stream) // length
  if available == 0:
    raise ValueError(f"calibration file {path} has {len(stream)} tokens, fewer than one "
                     f"sequence of --calib_len={length}")
  if available < samples:
    print(f"meshlm quantize: {path} holds only {available} sequences of {length} tokens "
          f"(--calib_samples={samples}); using {available}", flush=True)
  # Evenly spaced pieces: the whole file is represented, not just its start.
  picks = np.linspace(0, available - 1, min(samples, available)).round().astype(int)
  ids = np.asarray(stream[:available * length], np.int32).reshape(available, length)
  return ids[picks]


def _mb(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def _summary(plan: dict, before: int, after: int) -> str:
  counts = Counter(f.name for f in plan.values())
  kinds = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
  return (f"weights {_mb(before)} -> {_mb(after)} ({before / max(after, 1):.2f}x smaller); "
          f"plan: {kinds or 'nothing quantized'}")


def quantize_checkpoint(model_path: str, format: str, out: str, *, method: str = "gptq",
                        calib: str | None = None, calib_samples: int = 64, calib_len: int = 256,
                        embeddings: str = "auto", fit_groups: bool = False,
                        act_order: bool = True, clip_search: bool = True, tune_epochs: int = 0,
                        tune_lr: float = 2e-3) -> str:
  """Quantizes the model at `model_path` into the new directory `out`; returns a one-line
  summary. Raises ValueError / FileNotFoundError / FileExistsError for bad input, checked
  before the (slow) model load where it can be."""
  fmt = parse_format(format)
  if method not in METHODS:
    raise ValueError(f"--method {method}: use one of {', '.join(METHODS)}")
  if embeddings not in EMBEDDINGS:
    raise ValueError(f"--embeddings {embeddings}: use one of {', '.join(EMBEDDINGS)}")
  if method == "smooth" and not fmt.act8:
    raise ValueError(f"--method smooth smooths the activations an integer matmul quantizes: "
                     f"use an -a8 format (e.g. {fmt.name}-a8), not {fmt.name}")
  if method != "rtn" and calib is None:
    raise ValueError(f"--method {method} needs calibration text: --calib FILE "
                     "(.txt/.json/.jsonl); or use --method rtn")
  if tune_epochs and calib is None:
    raise ValueError(f"--tune_epochs={tune_epochs} needs calibration text: --calib FILE")
  if tune_epochs < 0 or not tune_lr > 0:
    raise ValueError(f"--tune_epochs={tune_epochs} must be >= 0 and --tune_lr={tune_lr} > 0")
  if calib is not None and not os.path.isfile(calib):
    raise FileNotFoundError(f"calibration file {calib} does not exist")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"output {out} already exists and is not an empty directory")
  model, tokenizer = load_any(model_path)
  if quantized_params(model):
    raise ValueError(f"{model_path} is already quantized; quantize the float model")
  rules = default_rules(fmt.name, EMBEDDINGS[embeddings])
  before = weight_bytes(model)
  calib_info = None
  if method != "rtn" or tune_epochs:
    if tokenizer is None:
      raise ValueError(f"{model_path} has no tokenizer to encode the calibration text")
    if calib_len > model.cfg.max_seq_len:
      raise ValueError(f"--calib_len={calib_len} exceeds the model's max_seq_len="
                       f"{model.cfg.max_seq_len}")
    ids_NT = calibration_ids(calib, tokenizer, calib_samples, calib_len)
    calib_info = dict(path=portable_path(calib), samples=int(ids_NT.shape[0]),
                      length=int(ids_NT.shape[1]))
  if method != "rtn":
    options = dict(fit_groups=fit_groups, act_order=act_order, clip_search=clip_search)
    if method == "gptq":
      plan = gptq_quantize(model, rules, ids_NT, **options)
    elif method == "smooth":
      plan, alphas = smooth_quantize(model, rules, ids_NT, fit_groups=fit_groups)
      calib_info["smooth_alpha"] = alphas
    else:
      plan, alphas = awq_quantize(model, rules, ids_NT, gptq=method == "awq-gptq", **options)
      calib_info["awq_alpha"] = alphas
    calib_info.update(act_order=act_order, clip_search=clip_search)
  else:
    plan = quantize_model(model, rules, fit_groups=fit_groups)
  if tune_epochs:
    teacher, _ = load_any(model_path)
    batch = min(8, int(ids_NT.shape[0]))
    kl = tune_scales(model, teacher, ids_NT, epochs=tune_epochs, batch=batch, lr=tune_lr)["kl"]
    calib_info["tune"] = dict(epochs=tune_epochs, lr=tune_lr, batch=batch, kl_first=kl[0],
                              kl_last=kl[-1])
    del teacher
  after = weight_bytes(model)
  meta = dict(method=method, format=fmt.name, embeddings=embeddings, fit_groups=fit_groups,
              source=portable_path(model_path), calibration=calib_info, bytes_before=before,
              bytes_after=after)
  path = save_quantized(model, tokenizer, out, plan, meta)
  return f"{method} {fmt.name} -> {path}: {_summary(plan, before, after)}"
