"""What a planned layout costs: the checkpoint interval (Young/Daly) and the cost per token
(step time from model FLOPs at an assumed MFU plus the planner's communication bytes, tokens
per day, and $ and kWh per million tokens)."""

import math

from parallel.mesh import MESH_AXES
from train.flops import train_flops_per_token
from train.plan.planner import Planner, Workload

# The step time is model FLOPs at an assumed MFU of the device
# peak (MFU covers everything that is not communication: kernel efficiency,
# remat recompute, a pipeline bubble) plus the communication `estimate` counts,
# at link bandwidths per device. Traffic on a mesh axis whose devices stay inside
# one host (see `comm_split`) moves at the intra-host bandwidth, the rest at the
# inter-host one; the two are added, never run concurrently.


def comm_split(estimate: dict, devices_per_host: int) -> tuple[float, float]:
  """(inter-host, intra-host) bytes per device per step of a planned layout.

  `parallel.make_mesh` reshapes the device list in MESH_AXES order, so the last
  axes are innermost: a collective over axes A stays inside a host when the
  devices from A's outermost axis inward, prod(sizes[MESH_AXES[i:]]), fit in one.
  """
  sizes = {a: estimate["mesh"].get(a, 1) for a in MESH_AXES}
  inter = intra = 0.0
  for row in estimate["comm"]:
    first = min(MESH_AXES.index(a) for a in row["axes"].split("+"))
    if math.prod(sizes[a] for a in MESH_AXES[first:]) <= devices_per_host:
      intra += row["bytes"]
    else:
      inter += row["bytes"]
  return inter, intra


def cost_estimate(step_flops: float, tokens_per_step: float, comm_bytes: float, devices: int,
                  peak_tflops: float, mfu: float, bandwidth_gbps: float,
                  price_per_device_hour: float, watts_per_device: float,
                  usd_per_kwh: float = 0.0, pue: float = 1.0, overlap: float = 0.0,
                  intra_comm_bytes: float = 0.0, intra_host_gbps: float = 0.0,
                  step_seconds: float = 0.0) -> dict:
  """Step time, throughput and cost per million tokens of one training step.

    compute  = step_flops / (devices · peak_tflops·1e12 · mfu)
    comm     = comm_bytes / (bandwidth_gbps·1e9) + intra_comm_bytes / (intra_host_gbps·1e9)
    step     = compute + comm − min(overlap · comm, compute)
  `overlap` is the fraction of communication hidden under compute: 0 (the
  default, conservative) adds it all, 1 gives max(compute, comm). A measured
  `step_seconds` > 0 replaces the estimate. Then tokens/s = tokens_per_step / step,
  device-hours per 1M tokens = devices · step / 3600 · 1e6 / tokens_per_step,
  kWh per 1M tokens = device-hours · watts_per_device / 1000 · pue, and
  $ per 1M tokens = device-hours · price_per_device_hour + kWh · usd_per_kwh.
  Arguments are named as `meshlm plan`'s flags; a bad one raises ValueError naming it.
  """
  positive = dict(step_flops=step_flops, tokens_per_step=tokens_per_step, devices=devices,
                  peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
  non_negative = dict(comm_bytes=comm_bytes, intra_comm_bytes=intra_comm_bytes,
                      price_per_device_hour=price_per_device_hour,
                      watts_per_device=watts_per_device, usd_per_kwh=usd_per_kwh,
                      step_seconds=step_seconds)
  for name, value in positive.items():
    if not value > 0:  # also rejects NaN
      raise ValueError(f"--{name}={value}: must be positive")
  for name, value in non_negative.items():
    if not value >= 0:
      raise ValueError(f"--{name}={value}: must be >= 0")
  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu}: must be in (0, 1]")
  if not 0 <= overlap <= 1:
    raise ValueError(f"--overlap={overlap}: must be in [0, 1]")
  if not pue >= 1:
    raise ValueError(f"--pue={pue}: must be >= 1")
  if intra_comm_bytes > 0 and not intra_host_gbps > 0:
    raise ValueError(f"--intra_host_gbps={intra_host_gbps}: must be positive when "
                     f"{intra_comm_bytes:.3g} bytes ride intra-host links")
  compute = step_flops / (devices * peak_tflops * 1e12 * mfu)
  inter_s = comm_bytes / (bandwidth_gbps * 1e9)
  intra_s = intra_comm_bytes / (intra_host_gbps * 1e9) if intra_comm_bytes else 0.0
  comm = inter_s + intra_s
  hidden = min(overlap * comm, compute)
  estimated = compute + comm - hidden
  step = step_seconds if step_seconds > 0 else estimated
  tokens_per_second = tokens_per_step / step
  device_hours = devices * step / 3600 * 1e6 / tokens_per_step
  kwh = device_hours * watts_per_device / 1000 * pue
  return dict(
      step_flops=step_flops, tokens_per_step=tokens_per_step, devices=devices,
      peak_tflops=peak_tflops, mfu=mfu, comm_bytes=comm_bytes, bandwidth_gbps=bandwidth_gbps,
      intra_comm_bytes=intra_comm_bytes, intra_host_gbps=intra_host_gbps, overlap=overlap,
      price_per_device_hour=price_per_device_hour, watts_per_device=watts_per_device,
      usd_per_kwh=usd_per_kwh, pue=pue,
      compute_seconds=compute, comm_seconds=comm, comm_inter_seconds=inter_s,
      comm_intra_seconds=intra_s, hidden_seconds=hidden, estimated_step_seconds=estimated,
      step_seconds=step, step_source="given" if step_seconds > 0 else "estimated",
      tokens_per_second=tokens_per_second, tokens_per_day=tokens_per_second * DAY_SECONDS,
      device_hours_per_million_tokens=device_hours,
      device_usd_per_million_tokens=device_hours * price_per_device_hour,
      kwh_per_million_tokens=kwh, energy_usd_per_million_tokens=kwh * usd_per_kwh,
      usd_per_million_tokens=device_hours * price_per_device_hour + kwh * usd_per_kwh)


# Checkpoint interval. Failures are assumed independent per device, so a job on
# n devices fails at n times the per-device rate (1e-4 per device-day: about 10
# failures a day at 100,000 devices). Each host writes its own devices' shards of
# the parameters and optimizer state in parallel, at `write_gbps_per_host` GB/s
# (storage that scales with the hosts: a parallel file system or object store);
# with a data axis replicated shards are counted on every device, an upper bound.
# The step time, unless given, is model FLOPs at an assumed MFU of the device peak.
DAY_SECONDS = 86_400.0


def young_daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
  """Young's optimal compute time between checkpoints, sqrt(2·C·M) seconds.

  First order in C/M (Young 1974); Daly (2006) adds terms that matter only when
  the checkpoint cost C approaches the mean time between failures M.
  """
  if checkpoint_seconds <= 0 or mtbf_seconds <= 0:
    raise ValueError(f"checkpoint_seconds ({checkpoint_seconds}) and mtbf_seconds "
                     f"({mtbf_seconds}) must be positive")
  return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def checkpoint_waste(interval_seconds: float, checkpoint_seconds: float,
                     mtbf_seconds: float) -> float:
  """First-order fraction of time lost: saving (C/τ) plus work redone after a failure (τ/2M)."""
  return checkpoint_seconds / interval_seconds + interval_seconds / (2.0 * mtbf_seconds)


def step_flops(work: Workload) -> float:
  """Model FLOPs of one step (train/flops.py's count; MoE: top_k experts' MLPs per token)."""
  cfg = work.model
  per_token = train_flops_per_token(cfg, work.seq_len)
  return per_token * work.batch_size * work.seq_len


def checkpoint_recommendation(planner: Planner, estimate: dict, devices: int,
                              failures_per_device_day: float = 1e-4,
                              write_gbps_per_host: float = 1.0, devices_per_host: int = 8,
                              step_seconds: float = 0.0, mfu: float = 0.4,
                              peak_tflops: float = 989.0) -> dict:
  """Young/Daly checkpoint interval for a planned layout (assumptions: see above)."""
  if min(failures_per_device_day, write_gbps_per_host, devices_per_host, mfu, peak_tflops) <= 0:
    raise ValueError("failure rate, write bandwidth, devices per host, MFU and peak must be "
                     "positive")
  mtbf = DAY_SECONDS / (failures_per_device_day * devices)
  per_device = estimate["memory"]["params"] + estimate["memory"]["optimizer"]
  per_host = per_device * min(devices_per_host, devices)
  cost = per_host / (write_gbps_per_host * 1e9)
  flops = step_flops(planner.work)
  if step_seconds > 0:
    source = "given"
  else:
    step_seconds = flops / (devices * peak_tflops * 1e12 * mfu)
    source = f"estimated at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s per device"
  interval = young_daly_interval(cost, mtbf)
  every = int(planner.config.checkpoint_every)
  return dict(failures_per_device_day=failures_per_device_day, devices=devices,
              mtbf_seconds=mtbf, state_bytes_per_device=per_device,
              devices_per_host=min(devices_per_host, devices), bytes_per_host=per_host,
              write_gbps_per_host=write_gbps_per_host, checkpoint_seconds=cost,
              step_flops=flops, step_seconds=step_seconds, step_source=source,
              interval_seconds=interval, interval_steps=max(1, round(interval / step_seconds)),
              waste=checkpoint_waste(interval, cost, mtbf), config_every=every,
              config_waste=checkpoint_waste(every * step_seconds, cost, mtbf))

