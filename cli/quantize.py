"""`meshlm quantize`: a model in, a quantized checkpoint directory out.

  meshlm quantize --model PATH --format int4-g128 [--method gptq|awq|awq-gptq|smooth|rtn]
                  [--calib DATA]
                  [--calib_samples 64] [--calib_len 256] [--embeddings auto|same|int8|none]
                  [--fit_groups] [--tune_epochs N [--tune_lr 2e-3]] --out DIR

--model takes what `meshlm generate` takes (workdir, HF directory, .gguf).
--calib (every method but rtn, and tuning) is a .txt file, or .json/.jsonl records whose
"instruction" + "output" (else "text") strings are used. --tune_epochs then trains the
group scales toward the float model on it (infer/quant/tune.py).
--embeddings auto (the default) keeps the embedding and LM head at INT8 under an INT4
format, as benchmarks/quant.py does: SmolLM2's tied embedding at INT4 takes INT4-g128 RTN
to +58.9% perplexity (docs/results.md, "Quantization"); `same` quantizes it like the rest.
Under an -a8 format auto keeps them at weight-only INT8 too, and --method smooth
(SmoothQuant-style smoothing, then round-to-nearest; infer/quant/smooth.py) moves the
activations' outliers into the weights: SmolLM2 int8-a8 +3.0% perplexity by rtn, +1.2%
smoothed.
"""

from absl import flags

from cli.parsing import parse, require, require_paths
from infer.quant.convert import EMBEDDINGS, METHODS, quantize_checkpoint


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "meshlm workdir, HF directory or .gguf file", flag_values=fv)
  flags.DEFINE_string("format", None, "int8, int8-asym, int8-zp, int4-gN, int4-gN-asym, "
                      "int4-gN-zp (e.g. int4-g128); a trailing -a8 (int8-a8, int4-g64-a8) "
                      "multiplies in integers: int8 activations per token, an int32 dot",
                      flag_values=fv)
  flags.DEFINE_enum("method", "gptq", list(METHODS),
                    "calibrated (needs --calib): gptq, awq (activation-aware scaling, then "
                    "round-to-nearest), awq-gptq (the scaling, then GPTQ), smooth (-a8 "
                    "formats: activation smoothing, then rounding); or rtn "
                    "(round-to-nearest)", flag_values=fv)
  flags.DEFINE_string("calib", None, "calibration text: .txt, .json or .jsonl", flag_values=fv)
  flags.DEFINE_integer("calib_samples", 64, "calibration sequences", flag_values=fv)
  flags.DEFINE_integer("calib_len", 256, "tokens per calibration sequence", flag_values=fv)
  flags.DEFINE_enum("embeddings", "auto", list(EMBEDDINGS),
                    "embeddings and LM head: auto (int8 under INT4 and -a8 formats, else like "
                    "the rest), "
                    "like the rest (same), int8, or kept float (none)", flag_values=fv)
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
  return fv


def main(argv: list[str], command: str = "quantize") -> None:
  """`meshlm quantize ARGS`: argv is everything after `quantize`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "model", "format", "out")
  require_paths(command, fv, "model", "calib")
  options = ("method", "calib", "calib_samples", "calib_len", "embeddings", "fit_groups",
             "act_order", "clip_search", "tune_epochs", "tune_lr")
  try:
    summary = quantize_checkpoint(fv["model"].value, fv["format"].value, fv["out"].value,
                                  **{name: fv[name].value for name in options})
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  print(f"meshlm {command}: {summary}", flush=True)
