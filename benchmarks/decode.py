"""Decode (inference) benchmarks of meshlm on this machine, one JSON document for all rows.

    python benchmarks/decode.py --json                 # every row, full sizes
    python benchmarks/decode.py --json --quick --rows 1,2

Rows:
  1  KV cache vs recomputation: Engine against infer.sampling.generate (which reruns the
     whole buffer every step), batch 1, N = 128/512/1024 new tokens (quick: 16/32).
  2  meshlm Engine.generate vs transformers generate(), same CPU, same process, same
     thread count: SmolLM2-135M-Instruct (one GGUF) and the reference small config, at
     batch 1 and 8, 64 new tokens (quick: 8, small config only). Target: 2x.
  3  continuous vs static batching (benchmarks/decode_serving.py)
  4  speculative decoding (benchmarks/decode_speculative.py)
  5  paged KV cache memory (benchmarks/decode_serving.py)
Rows 1 and 2 live in benchmarks/decode_baseline.py. Rows 3-5 come from modules imported
only when asked for; one that cannot be imported is reported as skipped, with the reason.
A row that raises is reported with its error, the others still run, and the exit status
is then 1.

Other processes on the cores make wall times noisy, PyTorch's far more than XLA's (see
benchmarks/train_throughput.py); the JSON records the load average before and after.
Only the JSON document goes to stdout; progress goes to stderr.
"""

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import cpu_count, log  # noqa: E402

ROWS = {
    "1": ("1_kv_cache_vs_recompute", "benchmarks.decode_baseline", "row_kv_cache_vs_recompute"),
    "2": ("2_vs_transformers", "benchmarks.decode_baseline", "row_vs_transformers"),
    "3": ("3_continuous_vs_static", "benchmarks.decode_serving", "run"),
    "4": ("4_speculative", "benchmarks.decode_speculative", "run"),
    "5": ("5_paged_memory", "benchmarks.decode_serving", "run"),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="compact JSON on stdout, nothing else")
  p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
  p.add_argument("--rows", default="1,2,3,4,5", help="comma-separated row numbers")
  args = p.parse_args(argv)
  args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  bad = [r for r in args.rows if r not in ROWS]
  if bad:
    p.error(f"unknown row(s) {bad}; choose from {sorted(ROWS)}")
  return args


def env_info() -> dict:
  import flax
  import jax
  info = {"jax": jax.__version__, "flax": flax.__version__, "python": platform.python_version(),
          "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
          "device_count": jax.device_count(), "cpu_count": cpu_count(),
          "machine": platform.machine(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
  try:
    import torch
    import transformers
    info.update(torch=torch.__version__, transformers=transformers.__version__)
  except Exception as e:  # noqa: BLE001 -- optional, row 2 reports the skip itself
    info.update(torch=None, torch_missing=f"{type(e).__name__}: {e}")
  return info


_SERVING: dict = {}  # decode_serving.run(quick) serves rows 3 and 5: run it once


def _row_of(out, key: str):
  """A shared module's answer for one row: out[key], out[key without "N_"], or all of it."""
  if isinstance(out, dict):
    for k in (key, key.split("_", 1)[1]):
      if k in out:
        return out[k]
  return out


def run_row(number: str, quick: bool) -> dict:
  """One row's result; import failures give {"skipped": ...}, errors {"error": ...}."""
  key, module, fn = ROWS[number]
  start = time.perf_counter()
  try:
    try:
      run = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
      return {"skipped": True, "reason": f"{module}.{fn}: {type(e).__name__}: {e}"}
    if module == "benchmarks.decode_serving":
      if "out" not in _SERVING:
        _SERVING["out"] = run(quick)
      out = _row_of(_SERVING["out"], key)
    else:
      out = run(quick)
  except Exception as e:  # noqa: BLE001 -- one failing row must not hide the others
    log(traceback.format_exc())
    return {"error": f"{type(e).__name__}: {e}", "wall_s": time.perf_counter() - start}
  if isinstance(out, dict) and "wall_s" not in out:
    out = {**out, "wall_s": time.perf_counter() - start}
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  start = time.perf_counter()
  load_start = os.getloadavg()[0]
  if load_start > 0.5:
    log(f"warning: 1-minute load average {load_start:.1f}; timings (mostly torch's) will suffer")
  rows = {}
  # Libraries (and other rows' code) may print; stdout is kept for the JSON document.
  with contextlib.redirect_stdout(sys.stderr):
    env = env_info()
    for number, (key, _, _) in ROWS.items():
      if number not in args.rows:
        rows[key] = {"skipped": True, "reason": "not selected (--rows)"}
        continue
      log(f"row {number} ({key}){' quick' if args.quick else ''}")
      rows[key] = run_row(number, args.quick)
  env["loadavg_1m"] = [load_start, os.getloadavg()[0]]
  result = {"benchmark": "decode", "quick": args.quick, "rows_selected": args.rows,
            "env": env, "rows": rows, "wall_s": time.perf_counter() - start}
  print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
  return 1 if any(isinstance(r, dict) and "error" in r for r in rows.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
