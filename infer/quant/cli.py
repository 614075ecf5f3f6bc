"""`meshlm quantize`: a model in, a quantized checkpoint directory out.

  meshlm quantize --model PATH --format int4-g128 [--method gptq|awq|awq-gptq|rtn] [--calib DATA]
                  [--calib_samples 64] [--calib_len 256] [--embeddings same|int8|none]
                  [--fit_groups] [--tune_epochs N [--tune_lr 2e-3]] --out DIR

--model takes what `meshlm generate` takes (workdir, HF directory, .gguf).
--calib (every method but rtn, and tuning) is a .txt file, or .json/.jsonl records whose
"instruction" + "output" (else "text") strings are used. --tune_epochs then trains the
group scales toward the float model on it (infer/quant/tune.py).
"""

import json
import os
import sys
from collections import Counter

import numpy as np
from absl import flags


def _flags(argv: list[str]):
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "meshlm workdir, HF directory or .gguf file", flag_values=fv)
  flags.DEFINE_string("format", None, "int8, int8-asym, int8-zp, int4-gN, int4-gN-asym, "
                      "int4-gN-zp (e.g. int4-g128)",
                      flag_values=fv)
  flags.DEFINE_enum("method", "gptq", ["gptq", "awq", "awq-gptq", "rtn"],
                    "calibrated (needs --calib): gptq, awq (activation-aware scaling, then "
                    "round-to-nearest), awq-gptq (the scaling, then GPTQ); or rtn "
                    "(round-to-nearest)", flag_values=fv)
  flags.DEFINE_string("calib", None, "calibration text: .txt, .json or .jsonl", flag_values=fv)
  flags.DEFINE_integer("calib_samples", 64, "calibration sequences", flag_values=fv)
  flags.DEFINE_integer("calib_len", 256, "tokens per calibration sequence", flag_values=fv)
  flags.DEFINE_enum("embeddings", "same", ["same", "int8", "none"],
                    "embeddings and LM head: like the rest, int8, or kept float", flag_values=fv)
  flags.DEFINE_bool("fit_groups", False, "halve a group that does not divide a layer's input "
                    "size until it does (default: refuse, naming the layer)", flag_values=fv)
  flags.DEFINE_string("out", None, "output directory (must not exist, or be empty)",
                      flag_values=fv)
  flags.DEFINE_bool("act_order", True, "GPTQ: rows in decreasing Hessian diagonal order, "
                    "group scales fixed up front", flag_values=fv)
  flags.DEFINE_bool("clip_search", True, "each group's range by least squared error (gptq, "
                    "awq-gptq) or least output error (awq)", flag_values=fv)
  flags.DEFINE_integer("tune_epochs", 0, "after quantizing, train the group scales for this "
                       "many epochs over the calibration text (needs --calib)", flag_values=fv)
  flags.DEFINE_float("tune_lr", 2e-3, "scale tuning: Adam learning rate of log-scales",
                     flag_values=fv)
  try:
    fv(["meshlm"] + argv)
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    raise SystemExit(f"meshlm quantize: {str(e).strip(chr(39))}")
  return fv


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


def main(argv: list[str] | None = None) -> None:
  """`meshlm quantize ARGS`: argv is everything after `quantize`."""
  argv = sys.argv[1:] if argv is None else list(argv)
  fv = _flags(argv)
  missing = [n for n in ("model", "format", "out") if fv[n].value is None]
  if missing:
    raise SystemExit(f"meshlm quantize: missing required flag(s): "
                     f"{', '.join('--' + n for n in missing)}")
  try:
    run(fv)
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    raise SystemExit(f"meshlm quantize: error: {e}") from e


def run(fv) -> None:
  from models.quant import default_rules, parse_format
  from infer.quant import quantize_model, weight_bytes
  from infer.quant.checkpoint import quantized_params, save_quantized
  from train.cli import load_any

  fmt, method, out = parse_format(fv["format"].value), fv["method"].value, fv["out"].value
  emb = {"same": "same", "int8": "int8", "none": None}[fv["embeddings"].value]
  calib = fv["calib"].value
  # Everything checkable without the model fails before the (slow) load.
  tune_epochs = fv["tune_epochs"].value
  if method != "rtn" and calib is None:
    raise ValueError(f"--method {method} needs calibration text: --calib FILE "
                     "(.txt/.json/.jsonl); or use --method rtn")
  if tune_epochs and calib is None:
    raise ValueError(f"--tune_epochs={tune_epochs} needs calibration text: --calib FILE")
  if tune_epochs < 0 or not fv["tune_lr"].value > 0:
    raise ValueError(f"--tune_epochs={tune_epochs} must be >= 0 and --tune_lr="
                     f"{fv['tune_lr'].value} > 0")
  if calib is not None and not os.path.isfile(calib):
    raise FileNotFoundError(f"calibration file {calib} does not exist")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"output {out} already exists and is not an empty directory")
  model, tokenizer = load_any(fv["model"].value, command="quantize")
  if quantized_params(model):
    raise ValueError(f"{fv['model'].value} is already quantized; quantize the float model")
  rules = default_rules(fmt.name, emb)
  before = weight_bytes(model)
  calib_info = None
  if method != "rtn" or tune_epochs:
    if tokenizer is None:
      raise ValueError(f"{fv['model'].value} has no tokenizer to encode the calibration text")
    length = fv["calib_len"].value
    if length > model.cfg.max_seq_len:
      raise ValueError(f"--calib_len={length} exceeds the model's max_seq_len="
                       f"{model.cfg.max_seq_len}")
    ids_NT = calibration_ids(calib, tokenizer, fv["calib_samples"].value, length)
    calib_info = dict(path=os.path.abspath(calib), samples=int(ids_NT.shape[0]),
                      length=int(ids_NT.shape[1]))
  if method != "rtn":
    options = dict(fit_groups=fv["fit_groups"].value, act_order=fv["act_order"].value,
                   clip_search=fv["clip_search"].value)
    if method == "gptq":
      from infer.quant.gptq import gptq_quantize
      plan = gptq_quantize(model, rules, ids_NT, **options)
    else:
      from infer.quant.awq import awq_quantize
      plan, alphas = awq_quantize(model, rules, ids_NT, gptq=method == "awq-gptq", **options)
      calib_info["awq_alpha"] = alphas
    calib_info.update(act_order=fv["act_order"].value, clip_search=fv["clip_search"].value)
  else:
    plan = quantize_model(model, rules, fit_groups=fv["fit_groups"].value)
  if tune_epochs:
    from infer.quant.tune import tune_scales
    teacher, _ = load_any(fv["model"].value, command="quantize")
    batch = min(8, int(ids_NT.shape[0]))
    kl = tune_scales(model, teacher, ids_NT, epochs=tune_epochs, batch=batch,
                     lr=fv["tune_lr"].value)["kl"]
    calib_info["tune"] = dict(epochs=tune_epochs, lr=fv["tune_lr"].value, batch=batch,
                              kl_first=kl[0], kl_last=kl[-1])
    del teacher
  after = weight_bytes(model)
  meta = dict(method=method, format=fmt.name, embeddings=fv["embeddings"].value,
              fit_groups=fv["fit_groups"].value, source=os.path.abspath(fv["model"].value),
              calibration=calib_info, bytes_before=before, bytes_after=after)
  path = save_quantized(model, tokenizer, out, plan, meta)
  print(f"meshlm quantize: {method} {fmt.name} -> {path}: {_summary(plan, before, after)}",
        flush=True)
