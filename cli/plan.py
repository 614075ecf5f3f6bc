"""`meshlm plan`: sizes a layout, checks it against an AOT compile, and suggests others.

  meshlm plan --config experiments/NAME.py --devices N [--mesh data=2,fsdp=4] [--sharding S]
              [--budget_gb X] [--compile] [--json] [--top K] [--config.KEY=VALUE ...]
  meshlm plan --config experiments/NAME.py --target v5p:4x4x4 --compile [--json]
              [--decode [--decode_batch B] [--decode_context T]]

Without --mesh/--sharding the config's `mesh` and `sharding` are planned. What each part
of the report assumes: train/plan/report.py. --target names a TPU slice as libtpu does
(v4/v5e/v5p/v6e:AxB[xC]) or a GPU node by chip and count (h100xN, a100xN): it sets
--devices to its chips and the cost model's peak and price to the chip's, and --compile
then compiles the step with that chip's own compiler (deviceless; libtpu must be installed,
pip install 'meshlm[tpu]', or for a GPU JAX's CUDA plugin, pip install 'meshlm[gpu]'),
reporting its per-chip
peak against the chip's HBM, its kernels and a step-time estimate
(train/plan/compile_target.py); --decode adds one decode step of the config's model
(a token per row against a paged cache of --decode_context tokens) compiled on one chip,
with its bytes and the compiler's time estimate (infer/compile_decode.py).
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from cli.parsing import UsageError, parse, require
from infer import compile_decode
from train.plan.report import COST_DEFAULTS, format_plan, parse_mesh, plan
from train.plan.targets import pallas_kernels, resolve


def make_flags(argv: list[str]) -> flags.FlagValues:
  """The flags; `argv` (after `plan`) names the --config.KEY overrides."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file", flag_values=fv,
                                  lock_config=True, sys_argv=["meshlm"] + list(argv))
  flags.DEFINE_integer("devices", None, "number of devices to plan for", flag_values=fv)
  flags.DEFINE_string("mesh", None, "axis sizes, e.g. data=2,fsdp=4 (default: config.mesh)",
                      flag_values=fv)
  flags.DEFINE_string("sharding", None, "layout, e.g. fsdp+tensor (default: config.sharding)",
                      flag_values=fv)
  flags.DEFINE_float("budget_gb", 0.0, "per-device memory budget in GiB (0: none)", flag_values=fv)
  flags.DEFINE_bool("compile", False, "AOT-compile the train step: on fake CPU devices, or with "
                    "--target by the target's own compiler", flag_values=fv)
  flags.DEFINE_bool("decode", False, "with --target and --compile: compile a decode step too",
                    flag_values=fv)
  flags.DEFINE_integer("decode_batch", 1, "--decode: rows per step", flag_values=fv)
  flags.DEFINE_integer("decode_context", 1024, "--decode: tokens already in each row's cache",
                       flag_values=fv)
  flags.DEFINE_string("target", None, "compile target, a TPU slice by libtpu's name, e.g. "
                      "v5p:4x4x4, or a GPU node, e.g. h100x8 (its chip count is --devices)",
                      flag_values=fv)
  flags.DEFINE_bool("json", False, "print one JSON document", flag_values=fv)
  flags.DEFINE_integer("top", 10, "suggestions to show", flag_values=fv)
  flags.DEFINE_bool("suggest", True, "enumerate and rank other layouts", flag_values=fv)
  flags.DEFINE_float("failures_per_device_day", 1e-4, "failure rate per device per day",
                     flag_values=fv)
  flags.DEFINE_float("checkpoint_gbps", 1.0, "checkpoint write bandwidth per host, GB/s",
                     flag_values=fv)
  flags.DEFINE_integer("devices_per_host", 8, "devices per host", flag_values=fv)
  flags.DEFINE_float("step_seconds", 0.0, "measured step time (0: estimate from FLOPs)",
                     flag_values=fv)
  flags.DEFINE_float("mfu", 0.4, "assumed MFU for the step-time estimate", flag_values=fv)
  flags.DEFINE_float("peak_tflops", 989.0, "peak TFLOP/s per device for the step-time estimate "
                     "(989: H100 dense bf16)", flag_values=fv)
  d = COST_DEFAULTS
  flags.DEFINE_float("bandwidth_gbps", d["bandwidth_gbps"], "cost: link bandwidth per device "
                     "between hosts, GB/s (50: one 400 Gb/s NIC per GPU)", flag_values=fv)
  flags.DEFINE_float("intra_host_gbps", d["intra_host_gbps"], "cost: link bandwidth per device "
                     "inside a host, GB/s (450: NVLink 4, one direction)", flag_values=fv)
  flags.DEFINE_float("overlap", d["overlap"], "cost: fraction of communication hidden under "
                     "compute (0: none, conservative; 1: step = max(compute, comm))",
                     flag_values=fv)
  flags.DEFINE_float("price_per_device_hour", d["price_per_device_hour"], "cost: $ per "
                     "device-hour (an example; use your price)", flag_values=fv)
  flags.DEFINE_float("watts_per_device", d["watts_per_device"], "cost: power per device, W "
                     "(700: H100 SXM board power)", flag_values=fv)
  flags.DEFINE_float("usd_per_kwh", d["usd_per_kwh"], "cost: energy price, $/kWh (0 when the "
                     "device price includes power)", flag_values=fv)
  flags.DEFINE_float("pue", d["pue"], "cost: power usage effectiveness (facility / device power)",
                     flag_values=fv)
  return fv


def main(argv: list[str], command: str = "plan") -> None:
  """`meshlm plan ARGS`: argv is everything after `plan`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "config")
  path = fv["config"].config_filename
  if not os.path.isfile(path.split(":")[0]):  # "path.py:arg" passes arg to get_config
    raise UsageError(f"meshlm {command}: config file {path} does not exist")
  for name in ("devices", "devices_per_host"):
    if fv[name].value is not None and fv[name].value < 1:
      raise UsageError(f"meshlm {command}: --{name}={fv[name].value} must be >= 1")
  try:
    target = resolve(fv["target"].value) if fv["target"].value else None
  except ValueError as e:
    raise UsageError(f"meshlm {command}: {e}") from None
  devices = fv["devices"].value
  if target and devices is not None and devices != target.chips:
    raise UsageError(f"meshlm {command}: --devices={devices} but --target {target.name} has "
                     f"{target.chips} chips")
  devices = target.chips if target else devices
  if devices is None:
    require(command, fv, "devices")
  if fv["decode"].value and not (target and fv["compile"].value):
    raise UsageError(f"meshlm {command}: --decode compiles a decode step for a target: give "
                     "--target and --compile too")
  try:
    mesh = parse_mesh(fv["mesh"].value) if fv["mesh"].value else None
  except ValueError as e:
    raise UsageError(f"meshlm {command}: {e}") from None
  try:
    checkpointing = dict(failures_per_device_day=fv["failures_per_device_day"].value,
                         write_gbps_per_host=fv["checkpoint_gbps"].value,
                         devices_per_host=fv["devices_per_host"].value,
                         step_seconds=fv["step_seconds"].value, mfu=fv["mfu"].value,
                         peak_tflops=fv["peak_tflops"].value)
    cost = {k: fv[k].value for k in COST_DEFAULTS}
    if target:  # the chip's figures, unless given
      for key, value in (("peak_tflops", target.chip.peak_tflops),
                         ("price_per_device_hour", target.chip.usd_per_hour)):
        if not fv[key].present:
          cost[key] = value
          if key in checkpointing:
            checkpointing[key] = value
    result = plan(fv["config"].value, devices, mesh, fv["sharding"].value,
                  fv["budget_gb"].value, fv["compile"].value, fv["top"].value, fv["suggest"].value,
                  checkpointing, cost, target.name if target else None)
    if fv["decode"].value:
      result["decode"] = compile_decode.compile_in_subprocess(
          fv["config"].value, target.name, fv["decode_batch"].value, fv["decode_context"].value)
  except (ValueError, RuntimeError) as e:  # RuntimeError: a compile that failed, its log
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  if fv["json"].value:
    print(json.dumps(result, indent=1, default=float))
  else:
    print(format_plan(result))
    if "decode" in result:
      print(format_decode(result["decode"]))


def format_decode(d: dict) -> str:
  cost = d.get("cost") or {}
  time = (f"; the compiler's estimate {cost['optimal_seconds'] * 1e3:.3g} ms a step"
          if cost.get("optimal_seconds", -1) > 0 else "")
  return (f"\ndecode step on one {d['device_kind']} ({d['target']}): batch {d['batch']}, "
          f"{d['context']} cached tokens a row: peak {d['peak'] / 2 ** 30:.3f} GiB, "
          f"{cost.get('bytes_accessed', 0) / 1e9:.3g} GB accessed{time}; "
          f"{pallas_kernels(d['kernels'])} Pallas kernel(s)")
