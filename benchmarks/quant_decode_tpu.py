"""Quantized decode on a TPU, by its compiler: a Llama-3.2-1B-shaped model's batch-1 decode
step (a token against a paged cache of 1,024 tokens) compiled deviceless for one v5e chip,
float against weight-only INT8 and INT4, W8A8, and an int8 KV cache.

  python benchmarks/quant_decode_tpu.py --json [--target v5e:2x2]

Each variant is compiled with its layers unrolled (infer/compile_decode.py), so the cost
model counts every layer; its bytes accessed and time estimate (`seconds_estimate`) are the
compiler's, not measurements. Weights are random, quantized round-to-nearest
(`default_rules`: the tied embedding in the same format). Targets (issue 55): weight-only
int8 reads <= 0.55x float's bytes and int4 <= 0.35x, with the time estimate <= 0.6x and
<= 0.4x. `float_weight_copies` counts float arrays of a quantized weight's size in the
optimized HLO outside fusions (a dequantized copy written to memory).
"""

import argparse
import json
import math
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import log  # noqa: E402
from infer import compile_decode  # noqa: E402
from train.defaults import base_config  # noqa: E402

MODEL = dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
             mlp_dim=8192, tie_embeddings=True, max_seq_len=2048, dtype="bfloat16",
             param_dtype="bfloat16", rope_theta=500000.0)
VARIANTS = {"float": (None, None), "int8": ("int8", None), "int4-g128": ("int4-g128", None),
            "int8-a8": ("int8-a8", None), "float, int8 KV cache": (None, "int8")}
TARGETS = {"int8": (0.55, 0.6), "int4-g128": (0.35, 0.4)}
# Elements of the quantized projections (q/o, k/v, gate/up/down) and of the tied table; no
# activation of a batch-1 step has these sizes (the caches are rank 5).
WEIGHT_SIZES = {2048 * 2048, 2048 * 512, 2048 * 8192, 128256 * 2048}


def float_weight_copies(hlo: str, sizes=WEIGHT_SIZES) -> int:
  """Top-level instructions (outside fused computations), parameters aside, whose result is a
  float array of rank <= 3 and a quantized weight's size: a dequantized weight in memory."""
  count, fused = 0, False
  for line in hlo.splitlines():
    if line and not line.startswith(" "):
      fused = line.startswith("%fused") or "fused_computation" in line
      continue
    m = re.match(r"\s*(?:ROOT )?%\S+ = (?:bf16|f32|f16)\[([\d,]+)\]", line)
    dims = [int(d) for d in m.group(1).split(",")] if m else []
    if (m and not fused and len(dims) <= 3 and math.prod(dims) in sizes
        and " parameter(" not in line):
      count += 1
  return count


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", action="store_true", help="print one JSON document (always)")
  ap.add_argument("--target", default="v5e:2x2", help="a TPU slice; one chip is compiled for")
  args = ap.parse_args(argv)
  config = base_config()
  config.model.update(MODEL)
  out = dict(benchmark="quant_decode_tpu", target=args.target, model=MODEL, batch=1,
             context=1024, variants={})
  for name, (quant, kv) in VARIANTS.items():
    log(f"{name}: quantize and compile")
    raw = compile_decode.compile_in_subprocess(config, args.target, 1, 1024, kv_dtype=kv,
                                               timeout=1800, quant=quant, unroll_layers=True,
                                               hlo=True)
    out["variants"][name] = dict(
        bytes_accessed=raw["cost"]["bytes_accessed"], seconds_estimate=raw["seconds_estimate"],
        peak_bytes=raw["peak"], kernels=raw["kernels"],
        float_weight_copies=float_weight_copies(raw["hlo"]))
  base = out["variants"]["float"]
  for name, v in out["variants"].items():
    v["bytes_over_float"] = v["bytes_accessed"] / base["bytes_accessed"]
    v["seconds_over_float"] = (v["seconds_estimate"] / base["seconds_estimate"]
                               if v["seconds_estimate"] and base["seconds_estimate"] else None)
    if name in TARGETS:
      bytes_target, seconds_target = TARGETS[name]
      v["target_met"] = (v["bytes_over_float"] <= bytes_target and v["seconds_over_float"]
                         is not None and v["seconds_over_float"] <= seconds_target)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
