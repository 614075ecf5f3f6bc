"""What `meshlm plan` (cli/plan.py) reports: a layout sized, checked against an AOT compile,
and others suggested.

Without --mesh/--sharding the config's `mesh` and `sharding` are planned. The
estimates come from `train.plan.planner`; --compile also compiles the real train
step on N fake CPU devices (`train.plan.aot`, in a subprocess) and prints XLA's
per-device memory next to the estimate. Suggestions enumerate meshes over
data/fsdp/tensor/pipeline (and expert for MoE configs) that factor N, drop
those that do not divide, and rank those within --budget_gb by communication
bytes per device per step / (1 − pipeline bubble).

It also recommends a checkpoint interval (Young/Daly, sqrt(2 × checkpoint cost ×
job MTBF)) from --failures_per_device_day, --checkpoint_gbps per host and
--devices_per_host, and a step time (--step_seconds, or model FLOPs at --mfu of
--peak_tflops); `train.plan.cost.checkpoint_recommendation` lists the assumptions.

And a cost per token (`train.plan.cost.cost_estimate`): step time = model FLOPs
at --mfu of --peak_tflops + communication at --bandwidth_gbps between hosts and
--intra_host_gbps inside one (less the --overlap fraction hidden under compute),
tokens per day, and $ and kWh per million tokens from --price_per_device_hour,
--watts_per_device, --pue and --usd_per_kwh.
"""

from train.plan import compile_target
from train.plan.aot import compare, compile_in_subprocess
from train.plan.cost import checkpoint_recommendation, comm_split, cost_estimate, step_flops
from train.plan.planner import GiB, Planner
from train.plan.targets import resolve

_AXES = ("data", "fsdp", "tensor", "pipeline", "expert", "sequence")
# Example figures, all flags: an H100 SXM (989 dense bf16 TFLOP/s, 700 W board power,
# NVLink 4 450 GB/s per direction, one 400 Gb/s NIC = 50 GB/s per GPU between hosts).
COST_DEFAULTS = dict(peak_tflops=989.0, mfu=0.4, bandwidth_gbps=50.0, intra_host_gbps=450.0,
                     devices_per_host=8, overlap=0.0, price_per_device_hour=2.50,
                     watts_per_device=700.0, usd_per_kwh=0.10, pue=1.0, step_seconds=0.0)


def _factorizations(n: int, parts: int):
  if parts == 1:
    yield (n,)
    return
  for d in range(1, n + 1):
    if n % d == 0:
      for rest in _factorizations(n // d, parts - 1):
        yield (d,) + rest


def layouts_for(sizes) -> list[str]:
  """The layouts using every axis of a mesh: a strategy per axis, ± ZeRO-1 and Megatron-SP."""
  parts = [a for a in ("pipeline", "fsdp", "tensor", "expert") if sizes.get(a, 1) > 1]
  variants = [parts]
  if sizes.get("data", 1) > 1:
    variants.append(parts + ["zero1"])
  if sizes.get("tensor", 1) > 1:
    variants += [v + ["sequence"] for v in list(variants)]
  return ["+".join(v) or "data_parallel" for v in variants]


def suggest(planner: Planner, devices: int, budget_bytes: float = 0, top: int = 10,
            platform: str = "cpu") -> dict:
  """Ranked layouts for `devices`; candidates that do not divide (ValueError) are dropped."""
  axes = ["data", "fsdp", "tensor", "pipeline"] + (["expert"] if planner.work.num_experts else [])
  ranked, rejected, over = [], 0, 0
  for factors in _factorizations(devices, len(axes)):
    sizes = dict(zip(axes, factors))
    for sharding in layouts_for(sizes):
      try:
        est = planner.estimate(sizes, sharding, devices, platform=platform)
      except ValueError:
        rejected += 1
        continue
      total = est["memory"]["total"]
      if budget_bytes and total > budget_bytes:
        over += 1
        continue
      bubble = est["pipeline"]["bubble"] if est["pipeline"] else 0.0
      ranked.append(dict(mesh=est["mesh"], sharding=sharding, memory=total,
                         comm=est["comm_total"], bubble=bubble,
                         score=est["comm_total"] / (1 - bubble)))
  ranked.sort(key=lambda r: (r["score"], r["memory"]))
  return dict(candidates=len(ranked) + rejected + over, not_dividing=rejected,
              over_budget=over, fitting=len(ranked), top=ranked[:top])


def parse_mesh(text: str) -> dict[str, int]:
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    axis, _, value = part.partition("=")
    if axis not in _AXES or not value.lstrip("-").isdigit():
      raise ValueError(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of {_AXES}")
    sizes[axis] = int(value)
  return sizes


def _gib(n: float) -> str:
  return f"{n / GiB:.2f}" if n >= GiB / 10 else f"{n / GiB:.3g}"


def _mesh_str(mesh) -> str:
  return " ".join(f"{a}={s}" for a, s in mesh.items())


def plan(config, devices: int, mesh=None, sharding=None, budget_gb=0.0, compile_=False,
         top=10, do_suggest=True, checkpointing: dict | None = None,
         cost: dict | None = None, target: str | None = None) -> dict:
  """Everything `meshlm plan` prints, as one JSON-able dict.

  `checkpointing`: keyword arguments of `checkpoint_recommendation` (defaults if None);
  `cost`: overrides of COST_DEFAULTS for `cost_estimate`; `target`: with `compile_`, compile
  for that target's chips by its own compiler (train/plan/compile_target.py) instead of on
  fake CPU devices.
  """
  planner = Planner(config)
  w = planner.work
  mesh = dict(config.mesh.to_dict() if mesh is None else mesh)
  sharding = sharding or config.sharding
  # A target's compiler holds the loss differently (planner.LOSS_BUFFERS).
  platform = resolve(target).chip.platform if target else "cpu"
  est = planner.estimate(mesh, sharding, devices, platform=platform)
  out = dict(params=planner.param_count, devices=devices, batch_size=w.batch_size,
             seq_len=w.seq_len, grad_accum=w.grad_accum, remat=w.model.remat,
             dtype=w.model.dtype, param_dtype=w.model.param_dtype,
             moe=dict(num_experts=w.num_experts, top_k=w.top_k) if w.num_experts else None,
             estimate=est, budget_gb=budget_gb or None)
  out["checkpointing"] = checkpoint_recommendation(planner, est, devices, **(checkpointing or {}))
  out["cost"] = plan_cost(planner, est, devices, **(cost or {}))
  if compile_ and target:
    raw = compile_target.compile_in_subprocess(config, target, est["mesh"], sharding)
    out.update(compile_target.summary(raw, est["memory"]["total"], step_flops(w),
                                      w.batch_size * w.seq_len))
  elif compile_:
    compiled = compile_in_subprocess(config, devices, est["mesh"], sharding)
    out["compiled"] = compiled
    out["comparison"] = compare(est["memory"]["total"], compiled)
    if w.model.dtype != "float32":  # the CPU backend computes bfloat16 in float32
      cpu = planner.estimate(mesh, sharding, devices, compute_dtype="float32")
      out["comparison_cpu"] = compare(cpu["memory"]["total"], compiled)
  if budget_gb:
    out["verdict"] = budget_verdict(budget_gb, est["memory"]["total"], out.get("compiled"),
                                    w.model.dtype, on_target=bool(compile_ and target))
  if do_suggest:
    out["suggestions"] = suggest(planner, devices, budget_gb * GiB, top, platform)
  return out


def budget_verdict(budget_gb: float, estimate: float, compiled: dict | None, dtype: str,
                   on_target: bool = False) -> dict:
  """Whether a layout fits `budget_gb` GiB per device, and on what evidence: the compiled
  peak when there is a compile, else the estimate. XLA:CPU runs bfloat16 math in float32,
  so for such models a compiled peak sizes a float32-activation program, not the accelerator's:
  the note says so, and names the estimate at the model's dtype beside it. `on_target`: the
  compile was the target's own (its `memory.peak`), which needs no such note."""
  budget = budget_gb * GiB
  if not compiled:
    return dict(fits=estimate <= budget, basis="estimate", bytes=int(estimate), note="")
  if on_target:
    peak = compiled["memory"]["peak"]
    return dict(fits=peak <= budget, basis=f"compiled peak ({compiled['target']})",
                bytes=int(peak), note="")
  peak = compiled["peak"]
  note = ""
  if dtype != "float32":
    note = (f"XLA:CPU running {dtype} math in float32; the {dtype} estimate, "
            f"{_gib(estimate)} GiB, {'fits' if estimate <= budget else 'does not fit'}")
    if peak > budget >= estimate:
      note += " but no compile checks it"
  return dict(fits=peak <= budget, basis="compiled peak", bytes=int(peak), note=note)


def format_verdict(budget_gb: float, v: dict) -> str:
  """'budget 80 GiB: fits (compiled peak 66.29 GiB; ...)': the verdict and what it rests on."""
  fits = "fits" if v["fits"] else "does not fit"
  note = f"; {v['note']}" if v["note"] else ""
  return f"budget {budget_gb:g} GiB: {fits} ({v['basis']} {_gib(v['bytes'])} GiB{note})"


def plan_cost(planner: Planner, est: dict, devices: int, **overrides) -> dict:
  """`cost_estimate` for a planned layout: its FLOPs, tokens and bytes, COST_DEFAULTS' figures."""
  unknown = sorted(set(overrides) - set(COST_DEFAULTS))
  if unknown:
    raise ValueError(f"unknown cost options {unknown}; known: {sorted(COST_DEFAULTS)}")
  c = dict(COST_DEFAULTS, **overrides)
  per_host = c.pop("devices_per_host")
  if per_host < 1:
    raise ValueError(f"--devices_per_host={per_host}: must be >= 1")
  inter, intra = comm_split(est, per_host)
  w = planner.work
  out = cost_estimate(step_flops(w), w.batch_size * w.seq_len, inter, devices,
                      intra_comm_bytes=intra, **c)
  out["devices_per_host"] = per_host
  return out


def format_plan(p: dict, command: str = "") -> str:
  est, mem = p["estimate"], p["estimate"]["memory"]
  lines = []
  if command:
    lines.append(f"$ {command}")
  moe = (f", MoE {p['moe']['num_experts']} experts top-{p['moe']['top_k']}" if p["moe"] else "")
  count = f"{p['params'] / 1e9:.2f}B" if p["params"] >= 1e9 else f"{p['params'] / 1e6:.1f}M"
  lines.append(f"{count} parameters{moe}; batch {p['batch_size']} x {p['seq_len']}"
               f" tokens, grad_accum {p['grad_accum']}, remat {p['remat']}, {p['dtype']} compute, "
               f"{p['param_dtype']} params")
  lines.append(f"{p['devices']} devices: mesh {_mesh_str(est['mesh'])}, sharding {est['sharding']}, "
               f"{est['rows_per_device']} row(s) per device per model call")
  for axis in est["unused_axes"]:
    lines.append(f"warning: mesh axis {axis}={est['mesh'][axis]} is not used by sharding "
                 f"{est['sharding']!r}: devices along it repeat the same work")
  if est["pipeline"]:
    pp = est["pipeline"]
    lines.append(f"pipeline: {pp['stages']} stages, {pp['microbatches']} microbatches, "
                 f"{pp['repeats']} repeat(s), {pp['schedule']}: bubble {pp['bubble']:.1%}")
  lines.append("")
  lines.append("memory per device                 GiB")
  for key in ("params", "grads", "optimizer", "activations", "batch", "total"):
    lines.append(f"  {key:<28s}{_gib(mem[key]):>9s}")
    if key == "activations":
      for k, v in est["activations"].items():
        lines.append(f"    {k:<26s}{_gib(v):>9s}")
  if p.get("verdict"):
    lines.append("  " + format_verdict(p["budget_gb"], p["verdict"]))
  lines.append("")
  lines.append("communication per device per step                      axes          GiB")
  for row in est["comm"]:
    lines.append(f"  {row['collective']:<53s}{row['axes']:<12s}{_gib(row['bytes']):>7s}")
  lines.append(f"  {'total':<65s}{_gib(est['comm_total']):>7s}")
  if p.get("checkpointing"):
    lines.append("")
    lines.extend(format_checkpointing(p["checkpointing"]))
  if p.get("cost"):
    lines.append("")
    lines.extend(format_cost(p["cost"]))
  if "compiled" in p and "estimate_over_compiled" in p:
    lines.append("")
    lines.extend(compile_target.format_summary(p["compiled"], p["estimate_over_compiled"]))
  elif "compiled" in p:
    lines.append("")
    if p["compiled"] is None:
      lines.append(p["compile_note"])
    else:
      c, cmp = p["compiled"], p["comparison"]
      lines.append(f"AOT compile of the train step on {c['devices']} fake CPU devices "
                   f"({c['compile_seconds']:.0f} s), XLA memory_analysis per device:")
      lines.append(f"  argument {_gib(c['argument'])} + output {_gib(c['output'])} - aliased "
                   f"{_gib(c['alias'])} + temp {_gib(c['temp'])} = {_gib(c['peak'])} GiB")
      if "comparison_cpu" in p:  # like for like: the estimate with the math XLA:CPU ran
        cpu = p["comparison_cpu"]
        lines.append(f"  like for like ({p['dtype']} math in float32, as XLA:CPU runs it): "
                     f"estimate {_gib(cpu['estimate'])} GiB / compiled {_gib(cpu['compiled'])} GiB "
                     f"= {cpu['ratio']:.2f}")
        lines.append(f"  estimate at {p['dtype']} (the accelerator's math) "
                     f"{_gib(cmp['estimate'])} GiB / compiled = {cmp['ratio']:.2f}")
      else:
        lines.append(f"  like for like: estimate {_gib(cmp['estimate'])} GiB / compiled "
                     f"{_gib(cmp['compiled'])} GiB = {cmp['ratio']:.2f}")
      if c.get("collectives"):
        lines.append("  collectives in the compiled step: " + ", ".join(
            f"{k} x{v}" for k, v in c["collectives"].items()))
  if "suggestions" in p:
    s = p["suggestions"]
    budget = f"estimated within {p['budget_gb']:g} GiB" if p["budget_gb"] else "(no budget)"
    lines.append("")
    lines.append(f"suggested layouts for {p['devices']} devices {budget}: {s['candidates']} "
                 f"candidates, {s['not_dividing']} do not divide, {s['over_budget']} over budget; "
                 "ranked by comm / (1 - bubble)")
    lines.append(f"  {'#':>2s}  {'mesh':<32s}{'sharding':<36s}{'mem GiB':>8s}{'comm GiB':>10s}"
                 f"{'bubble':>8s}")
    for i, r in enumerate(s["top"], 1):
      bubble = f"{r['bubble']:.0%}" if r["bubble"] else "-"
      lines.append(f"  {i:>2d}  {_mesh_str(r['mesh']):<32s}{r['sharding']:<36s}"
                   f"{_gib(r['memory']):>8s}{_gib(r['comm']):>10s}{bubble:>8s}")
  return "\n".join(lines)


def _duration(seconds: float) -> str:
  for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
    if seconds >= size:
      return f"{seconds / size:.1f} {unit}"
  return f"{seconds:.1f} s"


def format_checkpointing(c: dict) -> list[str]:
  return [
      f"checkpoint interval (Young/Daly): {c['failures_per_device_day']:g} failures per "
      f"device-day x {c['devices']} devices -> job MTBF {_duration(c['mtbf_seconds'])}",
      f"  checkpoint cost {c['checkpoint_seconds']:.1f} s: {_gib(c['state_bytes_per_device'])} "
      f"GiB of params+optimizer per device x {c['devices_per_host']} devices per host at "
      f"{c['write_gbps_per_host']:g} GB/s per host (a synchronous write; async saves block less)",
      f"  step {c['step_seconds']:.2f} s ({c['step_source']}; {c['step_flops']:.3g} FLOP/step)",
      f"  recommended: every {_duration(c['interval_seconds'])} = {c['interval_steps']:,} steps, "
      f"{c['waste']:.2%} of time lost to saves and redone work; config.checkpoint_every="
      f"{c['config_every']} ({_duration(c['config_every'] * c['step_seconds'])}): "
      f"{c['config_waste']:.2%}"]


def _count(n: float) -> str:
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:.3g}"


def format_cost(c: dict) -> list[str]:
  step = f"step {c['estimated_step_seconds']:.2f} s"
  if c["step_source"] == "given":
    step = f"step {c['step_seconds']:.2f} s (given); estimate {c['estimated_step_seconds']:.2f} s"
  return [
      f"cost per token (assumed: {c['mfu']:.0%} MFU of {c['peak_tflops']:g} TFLOP/s per device; "
      f"{c['bandwidth_gbps']:g} GB/s per device between hosts, {c['intra_host_gbps']:g} GB/s "
      f"inside a host of {c['devices_per_host']}; {c['overlap']:.0%} of communication "
      f"overlapped; ${c['price_per_device_hour']:.2f} per device-hour; "
      f"{c['watts_per_device']:g} W per device x PUE {c['pue']:g} at ${c['usd_per_kwh']:.2f}/kWh)",
      f"  {step} = compute {c['compute_seconds']:.2f} s ({c['step_flops']:.3g} FLOP) + "
      f"communication {c['comm_seconds']:.2f} s ({c['comm_bytes'] / 1e9:.1f} GB between hosts, "
      f"{c['intra_comm_bytes'] / 1e9:.1f} GB inside) - {c['hidden_seconds']:.2f} s overlapped",
      f"  {c['tokens_per_step']:,} tokens/step: {_count(c['tokens_per_second'])} tokens/s, "
      f"{_count(c['tokens_per_day'])} tokens/day on {c['devices']} devices",
      f"  per 1M tokens: {c['device_hours_per_million_tokens']:.3g} device-hours, "
      f"${c['device_usd_per_million_tokens']:.3g} devices + "
      f"${c['energy_usd_per_million_tokens']:.3g} energy = ${c['usd_per_million_tokens']:.3g}; "
      f"{c['kwh_per_million_tokens']:.3g} kWh"]
