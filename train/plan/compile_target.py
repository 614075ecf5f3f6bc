"""The train step compiled by a target's own compiler, deviceless, and the step time its cost
model gives once corrected for loops (`meshlm plan --target T --compile`).

`compile_for_target(config, target, mesh_sizes, sharding)` builds the mesh from the
target's compile-only devices (`train.plan.targets`), so tracing sees the target's
platform (`parallel.platform`) and picks its kernels, then compiles
`train.step.train_step` as `train.plan.aot.compile_memory` does.

The compiler's `cost_analysis()` counts a loop body once: the layer scan and the gradient-
accumulation loop. So two probes compile the same step with 1 and 2 layers, unrolled
(`model.scan_layers=False`, and the chunked loss's loop: `model.xent_unroll`), on one
microbatch (grad_accum 1, batch_size / grad_accum rows): per layer = probe2 − probe1, and
the step is grad_accum × (probe1 + (L − 1) × per layer). The optimizer update is thereby
counted grad_accum times, an overcount of its small share. The estimate is
`optimal_seconds`, the compiler's own time model summed over ops; a Pallas kernel counts
only what its cost estimate declares (the flops count may miss it), and an op with no cost
model adds -1 s, which leaves a negative total that is reported as no estimate. It is an
estimate of a compiler, not a measurement. A pipeline step runs its schedule in a loop too,
which probes of this kind do not unroll: no estimate is made for one (the reason is
returned).

libtpu takes a lockfile so that one process drives the chips; a deviceless compile drives
none, so `compile_in_subprocess` lets it share (ALLOW_MULTIPLE_LIBTPU_LOAD=1) with any other
process that loaded libtpu (a JAX process on a host with libtpu installed tries the TPU).

  echo '{"config": {...}, "target": "v5e:2x2", "mesh": {"data": 4}, "sharding": "data_parallel"}' \
    | python -m train.plan.compile_target
"""

import json
import os
import re
import subprocess
import sys
from typing import Mapping

from ml_collections import ConfigDict

from train.plan.aot import compile_memory
from train.plan.targets import GiB, cudnn_kernels, pallas_kernels, resolve, step_economics

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COST_KEYS = ("flops", "bytes_accessed", "optimal_seconds")


def probe_config(config: ConfigDict, layers: int) -> ConfigDict:
  """`config` at `layers` unrolled layers, its loss chunks unrolled, one microbatch
  (grad_accum 1)."""
  c = ConfigDict(config.to_dict())
  c.batch_size = int(config.batch_size) // int(config.grad_accum)
  c.grad_accum = 1
  c.model.num_layers = layers
  c.model.scan_layers = False
  c.model.xent_unroll = True  # the chunked loss's loop too (models/xent.py)
  return c


def extrapolate(one: dict, two: dict, layers: int, grad_accum: int) -> dict:
  """A whole step's cost from 1- and 2-layer probes of one microbatch (module docstring)."""
  out = {}
  for k in _COST_KEYS:
    if k in one and k in two:
      out[k] = grad_accum * (one[k] + (layers - 1) * (two[k] - one[k]))
  return out


def compile_for_target(config, target: str, mesh_sizes: Mapping[str, int], sharding: str,
                       probes: bool = True) -> dict:
  """The compiled step's facts on `target` (aot.compiled_facts), and `step_cost`, the loop-
  corrected cost model (None, with `step_cost_note`, where it cannot be made)."""
  config = config if isinstance(config, ConfigDict) else ConfigDict(config)
  tgt = resolve(target)
  devices = tgt.devices()
  out = compile_memory(config, mesh_sizes, sharding, devices)
  out.update(target=tgt.name, chips=tgt.chips, step_cost=None, step_cost_note="")
  if not probes:
    out["step_cost_note"] = "not asked for"
    return out
  if not out["cost"]:  # XLA's GPU compiler has none
    out["step_cost_note"] = (f"the {out['platform'].upper()} compiler gives no cost analysis: "
                             "no estimate")
    return out
  if int(dict(mesh_sizes).get("pipeline", 1)) > 1:
    out["step_cost_note"] = ("a pipeline runs its schedule in a loop that the cost model "
                             "counts once; layer probes do not unroll it: no estimate")
    return out
  layers, accum = int(config.model.num_layers), int(config.grad_accum)
  one, two = (compile_memory(probe_config(config, n), mesh_sizes, sharding, devices)
              for n in (1, 2))
  if not (one["cost"] and two["cost"]):
    out["step_cost_note"] = "the compiler gave no cost analysis"
    return out
  out["step_cost"] = extrapolate(one["cost"], two["cost"], layers, accum)
  out["probes"] = {str(n): dict(p["cost"], peak=p["peak"]) for n, p in ((1, one), (2, two))}
  return out


def run_deviceless(module: str, request: dict, what: str, timeout: float | None = None,
                   python: str = sys.executable) -> dict:
  """`python -m module` with `request` (JSON) on its standard input, in a fresh interpreter
  (`python`: another environment's, e.g. one with another jax) whose JAX stays on the host's
  CPU while libtpu compiles, sharing its lockfile; the JSON of its last line. RuntimeError
  names `what` failed, with the compiler's last words."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", "")).strip()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
  # Importing jax points TPU_LIBRARY_PATH at its own libtpu; another environment's jax must
  # load its own (an older libtpu rejects a newer jax's kernels).
  env.pop("TPU_LIBRARY_PATH", None)
  run = subprocess.run([python, "-m", module], input=json.dumps(request), env=env,
                       cwd=_REPO, capture_output=True, text=True, timeout=timeout)
  lines = run.stdout.strip().splitlines()
  if run.returncode != 0 or not lines:
    err = "\n".join(line for line in run.stderr.splitlines()
                    if not line.startswith(("WARNING", "E0000", "learning/", "=== Source")))
    raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
  return json.loads(lines[-1])


def compile_in_subprocess(config, target: str, mesh_sizes: Mapping[str, int], sharding: str,
                          probes: bool = True, timeout: float | None = None,
                          python: str = sys.executable) -> dict:
  """`compile_for_target` in a fresh interpreter (`run_deviceless`)."""
  config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  request = dict(config=config, target=target, mesh=dict(mesh_sizes), sharding=sharding,
                 probes=probes)
  return run_deviceless("train.plan.compile_target", request, f"compile for {target}", timeout,
                        python)


def summary(raw: dict, estimate_bytes: float, step_flops: float, tokens_per_step: int) -> dict:
  """What `meshlm plan --target T --compile --json` prints under `compiled`, from
  `compile_for_target`'s result: the compiled per-chip peak against the chip's HBM, the
  kernels and collectives, and the loop-corrected step time with what follows from it."""
  tgt = resolve(raw["target"])
  peak = raw["peak"]
  cost = raw.get("step_cost") or {}
  seconds = cost.get("optimal_seconds")
  out = dict(
      platform=raw["platform"], device_kind=raw["device_kind"], target=tgt.name,
      chips=tgt.chips, peak_gib=peak / GiB, hbm_gib=tgt.chip.hbm_gib,
      fits=peak <= tgt.chip.hbm_gib * GiB,
      kernels=dict(pallas=pallas_kernels(raw["kernels"]), cudnn=cudnn_kernels(raw["kernels"]),
                   custom_calls=raw["kernels"]),
      collectives=raw["collectives"], compile_seconds=raw["compile_seconds"],
      memory=dict(argument=raw["argument"], output=raw["output"], alias=raw["alias"],
                  temp=raw["temp"], peak=peak),
      step_seconds_estimate=None, step_seconds_basis=raw.get("step_cost_note", ""))
  if seconds is not None and seconds > 0:
    out["step_seconds_estimate"] = seconds
    out["step_seconds_basis"] = ("estimate: the compiler's cost model (optimal_seconds), "
                                 "1- and 2-layer probes extrapolated to the whole step")
    out["step_cost"] = cost
    out.update(step_economics(seconds, step_flops, tokens_per_step, tgt))
  elif seconds is not None:
    out["step_seconds_basis"] = (f"the cost model's optimal_seconds came out {seconds:.3g} "
                                 "(an op without a cost model): no estimate")
  return dict(compiled=out, estimate_over_compiled=estimate_bytes / peak if peak else None)


def format_summary(c: dict, ratio: float | None) -> list[str]:
  """Text lines for `summary`'s `compiled` block."""
  fits = "fits" if c["fits"] else "does NOT fit"
  lines = [f"compiled for {c['target']} ({c['chips']} x {c['device_kind']}, platform "
           f"{c['platform']}) by its own compiler, deviceless ({c['compile_seconds']:.0f} s):",
           f"  per-chip peak {c['peak_gib']:.2f} GiB of {c['hbm_gib']:g} GiB HBM: {fits}"
           + (f"; planner estimate / compiled = {ratio:.2f}" if ratio else ""),
           f"  kernels: {c['kernels']['pallas']} Pallas, {c['kernels']['cudnn']} cuDNN; "
           "custom calls "
           + (", ".join(f"{k} x{v}" for k, v in c["kernels"]["custom_calls"].items()) or "none")]
  if c["collectives"]:
    lines.append("  collectives: " + ", ".join(f"{k} x{v}" for k, v in c["collectives"].items()))
  if c["step_seconds_estimate"] is None:
    lines.append(f"  step time: not estimated ({c['step_seconds_basis']})")
  else:
    lines.append(f"  step {c['step_seconds_estimate']:.3g} s ({c['step_seconds_basis']}): "
                 f"{c['tokens_per_second_per_chip']:,.0f} tokens/s per chip, MFU "
                 f"{c['mfu']:.1%}, ${c['usd_per_million_tokens']:.3g} per million tokens at "
                 f"${c['usd_per_chip_hour']:.2f} per chip-hour (a list price: "
                 "train/plan/targets.py)")
  return lines


def _main():
  r = json.loads(sys.stdin.read())
  print(json.dumps(compile_for_target(r["config"], r["target"], r["mesh"], r["sharding"],
                                      r.get("probes", True))))


if __name__ == "__main__":
  _main()
