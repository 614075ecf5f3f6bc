"""Compile targets for `meshlm plan --target`: what a chip has, what it costs, its devices.

A target is a TPU slice by libtpu's topology name, "VERSION:AxBxC" ("v5e:2x2",
"v5p:4x4x4": the product is the chip count), or a GPU node by chip and count, "h100x8"
(or more, in hosts of 8). `resolve(name)` checks the name and returns a `Target`;
`Target.devices()` makes its compile-only devices (`parallel.compile_devices`: libtpu, or
JAX's CUDA plugin with XLA's description of the GPU; nothing is attached).

Chip facts are per chip, from the vendors' datasheets (../shared/REFERENCES.md,
"Accelerator facts"); a GPU's memory is what XLA's target config tells its compiler
(parallel/gpu_targets/), and the A100's peak and bandwidth are NVIDIA's datasheet's
(bandwidth as in that config). Prices are list prices for one chip-hour, on demand, and are
examples to replace with yours (`--price_per_device_hour`): PRICE_SOURCE says where
they come from and when.
"""

import dataclasses
import math
import re

import parallel

GiB = 2 ** 30
PRICE_SOURCE = ("Google Cloud on-demand list prices per chip-hour (us-central regions) as "
                "published in 2025: TPUs, and a GPU's share of an 8-GPU A3 (H100) or A2 "
                "ultra (A100 80GB) VM; written down on 2026-12-07 without re-checking the page "
                "(this machine has no web access): pass --price_per_device_hour for yours")


@dataclasses.dataclass(frozen=True)
class Chip:
  platform: str        # parallel.platform's name: "tpu" | "gpu"
  hbm_gib: float       # memory per chip, GiB
  peak_tflops: float   # dense bf16 TFLOP/s per chip
  hbm_tbps: float      # memory bandwidth per chip, TB/s
  usd_per_hour: float  # list price per chip-hour (PRICE_SOURCE)


CHIPS = {
    "v4": Chip("tpu", 32.0, 275.0, 1.2, 3.22),
    "v5e": Chip("tpu", 16.0, 197.0, 0.82, 1.20),
    "v5p": Chip("tpu", 95.0, 459.0, 2.76, 4.20),
    "v6e": Chip("tpu", 32.0, 918.0, 1.64, 2.70),
    "h100": Chip("gpu", 84942979072 / GiB, 989.0, 3.35, 11.06),
    "a100": Chip("gpu", 85100068864 / GiB, 312.0, 2.04, 5.07),
}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str       # as given, e.g. "v5p:4x4x4"
  version: str    # key of CHIPS
  chips: int
  chip: Chip

  def devices(self) -> list:
    """The target's compile-only devices (ValueError naming what is missing)."""
    devices = parallel.compile_devices(self.name)
    if len(devices) != self.chips:
      raise ValueError(f"target {self.name}: the compiler made {len(devices)} devices, expected "
                       f"{self.chips}")
    return devices


def resolve(name: str) -> Target:
  """The target named `name`; ValueError lists the names understood."""
  name = name.strip()
  tpu = re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)*)", name)
  gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", name)
  if tpu and tpu.group(1) in CHIPS and CHIPS[tpu.group(1)].platform == "tpu":
    chips = math.prod(int(x) for x in tpu.group(2).split("x"))
    return Target(name, tpu.group(1), chips, CHIPS[tpu.group(1)])
  if gpu and gpu.group(1) in parallel.GPU_TARGETS and int(gpu.group(2)) > 0:
    return Target(name, gpu.group(1), int(gpu.group(2)), CHIPS[gpu.group(1)])
  tpus = ", ".join(f"{v}:AxB[xC]" for v, c in CHIPS.items() if c.platform == "tpu")
  gpus = ", ".join(f"{v}xN" for v in parallel.GPU_TARGETS)
  raise ValueError(f"--target {name!r}: not a known target; TPU slices are named as libtpu "
                   f"names them ({tpus}, e.g. v5p:4x4x4), GPU nodes by chip and count ({gpus}, "
                   "e.g. h100x8)")


def pallas_kernels(kernels: dict[str, int]) -> int:
  """Pallas (Mosaic) kernel calls among an executable's custom calls (aot.kernel_counts)."""
  return kernels.get("tpu_custom_call", 0)


def cudnn_kernels(kernels: dict[str, int]) -> int:
  """cuDNN calls (fused attention: "__cudnn$fmha…") among an executable's custom calls."""
  return sum(n for k, n in kernels.items() if k.startswith("__cudnn$"))


def step_economics(step_seconds: float, step_flops: float, tokens_per_step: int,
                   target: Target) -> dict:
  """Tokens/s per chip, MFU and $ per million tokens for a step time on `target`."""
  chips, chip = target.chips, target.chip
  return dict(
      tokens_per_second_per_chip=tokens_per_step / step_seconds / chips,
      mfu=step_flops / (step_seconds * chips * chip.peak_tflops * 1e12),
      usd_per_million_tokens=chip.usd_per_hour * chips * step_seconds / 3600
      / tokens_per_step * 1e6,
      usd_per_chip_hour=chip.usd_per_hour, price_source=PRICE_SOURCE)
