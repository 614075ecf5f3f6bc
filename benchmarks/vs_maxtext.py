"""meshlm against MaxText on one compiler: Llama-3-8B's train step for one TPU slice.

Both steps are compiled, deviceless, for the same slice by the same libtpu; the JSON has each
side's per-chip peak memory and the compiler's step-time estimate.

  python benchmarks/vs_maxtext.py --json [--venv DIR] [--python python3.12]

MaxText needs Python >= 3.12 and its own jax, so it lives in a virtual environment of its own
(--venv, made on first use): `maxtext[tpu]==0.2.5` as it installs itself (jax 0.12.1 and
libtpu 0.0.52 here), then meshlm from this checkout with `--no-deps` and those of its
dependencies MaxText does not bring. Both sides are compiled by that environment's jax and
libtpu: one compiler.

The layout is MaxText's `train_compile` for llama3-8b on v5p-128 (64 chips): per-device batch
1 with gradient accumulation 4 (256 rows of 8,192 tokens a step), full remat, FSDP over 64,
float32 weights and bfloat16 compute; meshlm's is experiments/llama3_8b_pod.py, which is the
same, compiled as-is (`xent=logits`) and with the fused chunked cross-entropy
(`--config.model.xent=chunked`, models/xent.py).

The step-time estimate is the compiler's cost model (`optimal_seconds`) with the same loop
correction for both (train/plan/compile_target.py): 1- and 2-layer unrolled probes of one
microbatch, extrapolated to 32 layers and 4 microbatches; meshlm's probes also unroll the
chunked loss's loop (`model.xent_unroll`), so every chunk is counted. Targets (issue 55):
meshlm's peak <= MaxText's and its estimate <= 1.0x MaxText's, judged per variant.
"""

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import log  # noqa: E402
from experiments import llama3_8b_pod  # noqa: E402
from train.plan.compile_target import compile_in_subprocess, extrapolate  # noqa: E402

MAXTEXT = "maxtext[tpu]==0.2.5"
# meshlm's own dependencies that MaxText's environment keeps at its versions.
KEEP = ("jax", "flax", "optax", "orbax-checkpoint", "chex", "grain", "tensorstore", "numpy")
LAYERS, ACCUM = 32, 4
MAXTEXT_ARGS = dict(model_name="llama3-8b", compile_topology="v5p-128",
                    compile_topology_num_slices=1, per_device_batch_size=1,
                    gradient_accumulation_steps=ACCUM, max_target_length=8192, remat_policy="full",
                    ici_fsdp_parallelism=64, weight_dtype="float32", dtype="bfloat16")
TARGET = "v5p:4x4x4"  # the same 64 chips, by libtpu's name


def ensure_venv(venv: str, python: str) -> str:
  """The environment's interpreter, after creating and filling it if it has no MaxText."""
  py = os.path.join(venv, "bin", "python")
  if not os.path.exists(py):
    subprocess.run([python, "-m", "venv", venv], check=True)
  def importable(modules: str) -> bool:
    return subprocess.run([py, "-c", f"import {modules}"], capture_output=True,
                          cwd=REPO).returncode == 0

  if not importable("maxtext"):
    log(f"installing {MAXTEXT} into {venv} (several minutes)")
    subprocess.run([py, "-m", "pip", "install", "-q", MAXTEXT], check=True)
  if not importable("train.plan.compile_target, infer"):
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
      deps = tomllib.load(f)["project"]["dependencies"]
    rest = [d for d in deps if re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() not in KEEP]
    subprocess.run([py, "-m", "pip", "install", "-q", *rest], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO], check=True)
  return py


def versions(py: str) -> dict:
  code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
          "('jax', 'jaxlib', 'libtpu', 'maxtext', 'flax')}))")
  return json.loads(subprocess.run([py, "-c", code], capture_output=True, text=True,
                                   check=True).stdout)


def maxtext_compile(py: str, **overrides) -> dict:
  """MaxText's train_compile with MAXTEXT_ARGS and `overrides`: its memory and cost analysis."""
  base = subprocess.run([py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  args = dict(MAXTEXT_ARGS, base_output_directory="/tmp/vs_maxtext", run_name="vs_meshlm",
              **overrides)
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  # This process's jax pointed TPU_LIBRARY_PATH at its own, older libtpu, which rejects the
  # newer jax's Pallas kernels ("no such field: 'debug_locations'"): MaxText loads its own.
  env.pop("TPU_LIBRARY_PATH", None)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as cwd:
    run = subprocess.run([py, "-m", "maxtext.trainers.pre_train.train_compile",
                          os.path.join(base, "configs", "base.yml"),
                          *(f"{k}={v}" for k, v in args.items())],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
  out = run.stdout + run.stderr
  if run.returncode != 0:
    raise RuntimeError(f"MaxText train_compile {overrides} failed:\n{out[-3000:]}")
  return dict(parse_train_compile(out), seconds=round(time.perf_counter() - start, 1))


def parse_train_compile(out: str) -> dict:
  """The per-device peak (arguments + outputs - aliased + temporaries) and the cost analysis
  from what MaxText's train_compile prints; ValueError where either line is missing."""
  mem = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", out)
  cost = re.search(r"Cost analysis: (\{.*\})", out)
  if not mem or not cost:
    raise ValueError(f"no memory or cost analysis in train_compile's output:\n{out[-2000:]}")
  m = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", mem.group(1))}
  c = ast.literal_eval(cost.group(1))
  peak = (m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
          + m["temp_size_in_bytes"])
  return dict(peak=peak, cost={"flops": c["flops"], "bytes_accessed": c["bytes accessed"],
                               "optimal_seconds": c["optimal_seconds"]})


def maxtext_side(py: str) -> dict:
  full = maxtext_compile(py)
  probes = [maxtext_compile(py, base_num_decoder_layers=n, override_model_config="true",
                            scan_layers="false", gradient_accumulation_steps=1) for n in (1, 2)]
  step = extrapolate(probes[0]["cost"], probes[1]["cost"], LAYERS, ACCUM)
  return dict(peak_gib=full["peak"] / 2 ** 30, step_seconds_estimate=step["optimal_seconds"],
              step_cost=step, full_step_cost=full["cost"], compile_seconds=full["seconds"])


def meshlm_side(py: str, xent: str) -> dict:
  config = llama3_8b_pod.get_config()
  config.model.xent = xent
  raw = compile_in_subprocess(config, TARGET, config.mesh.to_dict(), config.sharding,
                              timeout=3600, python=py)
  step = raw["step_cost"] or {}
  return dict(xent=xent, peak_gib=raw["peak"] / 2 ** 30,
              step_seconds_estimate=step.get("optimal_seconds"), step_cost=step,
              full_step_cost=raw["cost"], pallas_kernels=raw["kernels"].get("tpu_custom_call", 0),
              compile_seconds=raw["compile_seconds"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", action="store_true", help="print one JSON document (always)")
  ap.add_argument("--venv", default=os.path.expanduser("~/.cache/meshlm/maxtext-venv"),
                  help="MaxText's virtual environment (made and filled on first use)")
  ap.add_argument("--python", default="python3.12", help="interpreter that makes the venv")
  args = ap.parse_args(argv)
  py = ensure_venv(args.venv, args.python)
  out = dict(benchmark="vs_maxtext", target=TARGET, maxtext_topology="v5p-128",
             versions=versions(py), layout=MAXTEXT_ARGS)
  log("MaxText: full step and two probes")
  out["maxtext"] = maxtext_side(py)
  out["meshlm"] = {}
  for xent in ("logits", "chunked"):
    log(f"meshlm xent={xent}: full step and two probes")
    out["meshlm"][xent] = meshlm_side(py, xent)
  mt = out["maxtext"]
  for side in out["meshlm"].values():
    side["peak_over_maxtext"] = side["peak_gib"] / mt["peak_gib"]
    side["step_estimate_over_maxtext"] = side["step_seconds_estimate"] / mt["step_seconds_estimate"]
    side["peak_target_met"] = side["peak_over_maxtext"] <= 1.0
    side["step_target_met"] = side["step_estimate_over_maxtext"] <= 1.0
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
