"""Chaos soak: `meshlm train` SIGKILLed at random and restarted, per checkpoint interval.

  python -m benchmarks.chaos --workdir runs/chaos \\
      [--config.chaos.mtbf_seconds=20] [--config.chaos.checkpoint_intervals=5,20,80]

For each interval in `chaos.checkpoint_intervals` (steps) a fresh run in
WORKDIR/every_K is launched as a subprocess; a failure time is drawn from an
exponential distribution with mean `chaos.mtbf_seconds` at every start, and the
whole process group is SIGKILLed when it comes (start-up and compilation are
not spared). The run is then started again with the same command, as a
scheduler would, until it exits 0. Every interval sees the same failure draws
(`chaos.seed`), so differences come from the interval. Other `--config.KEY=V`
flags are passed to the training runs; training keys live at the top level, as
in experiments/quickstart.py (the run's config is experiments/chaos.py), and
`meshlm train --config experiments/chaos.py`
trains the same run once without failures.

Measured per interval: wall time from the first launch to the last exit;
goodput = productive step time (WORKDIR/every_K/goodput.json, `train`) / wall
time; the step time (median of the steps furthest from a save); `ideal` = steps
× that step time / wall time (goodput.json counts steps slowed by background
checkpoint writes as productive); the checkpoint cost per save: the loop's
blocking time, and the effective cost, all step time beyond the step time
divided by the saves (it also catches background writing); the start-up time
(launch to first step). `--analyse_only` recomputes all of it from a workdir.
The best interval is compared with Young/Daly, sqrt(2 × checkpoint cost ×
MTBF), and with the interval maximising the expected goodput of exponential
failures with restart cost R: τ / (M·e^(R/M)·(e^((τ+C)/M) − 1)). Writes
WORKDIR/chaos.json and WORKDIR/chaos.png (an SVG without matplotlib).

Restarts are fast because each interval's runs share a persistent JAX
compilation cache (WORKDIR/every_K/jax_cache), as production jobs should.

The same restart loop on a cluster:
  SLURM:  `#SBATCH --requeue` and `srun ... meshlm train ...` in the batch script;
          a node failure requeues the job with the same command and workdir.
          `#SBATCH --signal=TERM@120` sends SIGTERM 2 minutes before the time
          limit: the loop checkpoints and exits 75, so `scontrol requeue
          $SLURM_JOB_ID` on exit status 75/76/77 restarts it (train/exit_codes.py).
  Kubernetes: a Job with `backoffLimit: N` (and `podFailurePolicy` to Ignore
          exit 75 so preemptions do not count against it) recreates failed pods;
          a JobSet with `failurePolicy: {maxRestarts: N}` restarts all the
          multi-host workers together, which jax.distributed needs. The workdir
          must be on shared storage (a PVC or GCS) for either to resume.
"""

import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from ml_collections import ConfigDict  # noqa: E402

from experiments import chaos as chaos_config  # noqa: E402


def read_records(path: str) -> list[dict]:
  """metrics.jsonl, skipping a line torn by a SIGKILL mid-write."""
  out = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          pass
  return out


def run_with_failures(cmd: list[str], workdir: str, chaos, env: dict, rng: random.Random) -> dict:
  """The restart loop: launch, SIGKILL at an exponential time, relaunch until exit 0."""
  os.makedirs(workdir, exist_ok=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  starts, kills, start_seconds, exits = 0, 0, [], []  # launch to first step, None if none
  first = time.perf_counter()
  with open(os.path.join(workdir, "chaos_train.log"), "ab") as log:
    while True:
      if starts > chaos.max_restarts:
        return dict(completed=False, reason=f"gave up after {chaos.max_restarts} restarts",
                    starts=starts, kills=kills, start_seconds=start_seconds, exits=exits,
                    wall_seconds=time.perf_counter() - first)
      if starts:
        time.sleep(chaos.restart_delay_seconds)
      failure_in = rng.expovariate(1.0 / chaos.mtbf_seconds)
      if 0 <= chaos.max_kills <= kills:
        failure_in = math.inf
      size = os.path.getsize(metrics) if os.path.exists(metrics) else 0
      launched = time.perf_counter()
      # A session of its own: the kill takes the whole process group, as a node failure would.
      proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
      starts += 1
      first_step = None
      while proc.poll() is None:
        now = time.perf_counter()
        if first_step is None and os.path.exists(metrics) and os.path.getsize(metrics) > size:
          first_step = now - launched
        if now - launched >= failure_in or now - first > chaos.max_wall_seconds:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
          break
        time.sleep(0.02)
      start_seconds.append(first_step)
      exits.append(proc.returncode)
      if proc.returncode == -signal.SIGKILL:
        if time.perf_counter() - first > chaos.max_wall_seconds:
          return dict(completed=False, reason="max_wall_seconds reached", starts=starts,
                      kills=kills, start_seconds=start_seconds, exits=exits,
                      wall_seconds=time.perf_counter() - first)
        kills += 1
        continue
      if proc.returncode == 0:
        return dict(completed=True, starts=starts, kills=kills, start_seconds=start_seconds,
                    exits=exits, wall_seconds=time.perf_counter() - first)
      if proc.returncode not in (75, 76, 77):  # train/exit_codes.py: only these mean "restart"
        log.flush()
        with open(os.path.join(workdir, "chaos_train.log"), errors="replace") as f:
          tail = f.read()[-3000:]
        raise RuntimeError(f"training exited {proc.returncode}, not restartable:\n{tail}")


def measure(workdir: str, every: int, config) -> dict:
  """Step time, checkpoint cost and goodput seconds of a finished run, from its own files."""
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(workdir, "goodput.json")) as f:
    goodput = json.load(f)
  tokens = config.batch_size * config.seq_len
  windows, far, after_save = [], [], 0
  for r in records:  # a record's window spans the save at the previous step, if there was one
    if "tokens_per_s" not in r or r["step"] == config.steps:
      continue  # compile steps carry no window; the last one includes the final evaluation
    windows.append(tokens / r["tokens_per_s"])
    position = (r["step"] - 1) % every
    after_save += position == 0
    if position >= every / 2:
      far.append(windows[-1])
  # The step time: the median of the steps furthest from a save, in this run, so that load
  # from other processes that differs between runs does not count. All step time beyond it is
  # charged to the saves: background writing slows several steps, which blocking time misses.
  step = statistics.median(far or windows)
  saves = sum(1 for r in records if r["step"] % every == 0 or r["step"] == config.steps)
  return dict(step_seconds=step, saves=saves,
              checkpoint_effective_seconds=((sum(windows) - len(windows) * step) / after_save
                                            if far and after_save else None),
              checkpoint_blocking_seconds=goodput["seconds"]["checkpoint"] / max(saves, 1),
              goodput_json=goodput["goodput"], seconds=goodput["seconds"],
              logged_steps=len(records))


def expected_goodput(tau: float, cost: float, restart: float, mtbf: float) -> float:
  """Useful fraction of wall time for segments of τ work + C saving, exponential failures,
  restart cost R (failures can strike during restarts too): τ / (M·e^(R/M)·(e^((τ+C)/M) − 1))."""
  exponent = (tau + cost) / mtbf
  if exponent > 700:  # beyond float range: the run practically never finishes a segment
    return 0.0
  return tau / (mtbf * math.exp(restart / mtbf) * math.expm1(exponent))


def predicted_goodput(tau: float, s: dict) -> float:
  """The whole run's: a cold first start, then steady state (`expected_goodput`)."""
  steady = expected_goodput(tau, s["checkpoint_seconds"], s["restart_seconds"], s["mtbf_seconds"])
  work = s["work_seconds"]
  return work / (s["first_start_seconds"] + work / steady) if steady else 0.0


def analyse(runs: list[dict], chaos, steps: int) -> dict:
  from train.plan.cost import young_daly_interval
  mtbf = float(chaos.mtbf_seconds)
  step = statistics.median(r["step_seconds"] for r in runs)
  for r in runs:
    r["goodput_steps"] = steps * r["step_seconds"] / r["wall_seconds"]
  # C from the shortest interval: its noise per save (window noise × interval) is the least.
  costs = [r["checkpoint_effective_seconds"] for r in sorted(runs, key=lambda r: r["every"])
           if r["checkpoint_effective_seconds"] is not None]
  blocking = statistics.median(r["checkpoint_blocking_seconds"] for r in runs)
  cost = max(costs[0], blocking) if costs else blocking
  # The first start to reach a step was cold (tokenizer training, empty compilation cache):
  # counted once; the later ones are restarts.
  reached = [[x for x in r["start_seconds"] if x is not None] for r in runs]
  first = statistics.median(x[0] for x in reached if x)
  restarts = [y for x in reached for y in x[1:]]
  restart = statistics.median(restarts) if restarts else first
  out = dict(mtbf_seconds=mtbf, step_seconds=step, checkpoint_seconds=cost,
             checkpoint_blocking_seconds=blocking, restart_seconds=restart,
             first_start_seconds=first, work_seconds=steps * step)
  for r in runs:
    r["predicted_goodput"] = predicted_goodput(r["every"] * step, out)
  taus = [step * 1.05 ** k for k in range(400) if step * 1.05 ** k < 50 * mtbf]
  best_model = max(taus, key=lambda t: expected_goodput(t, cost, restart, mtbf))
  yd = young_daly_interval(cost, mtbf)
  best = max(runs, key=lambda r: r["goodput"]) if all(r["completed"] for r in runs) else None
  return dict(out, young_daly_seconds=yd, young_daly_steps=yd / step,
              model_optimum_seconds=best_model, model_optimum_steps=best_model / step,
              best_measured_every=best["every"] if best else None,
              kills=sum(r["kills"] for r in runs),
              wall_per_kill_seconds=(sum(r["wall_seconds"] for r in runs) /
                                     max(1, sum(r["kills"] for r in runs))))


def format_table(runs: list[dict], s: dict) -> str:
  lines = [f"{'every':>6s}{'every s':>9s}{'starts':>7s}{'kills':>6s}{'wall s':>8s}{'train s':>8s}"
           f"{'redo s':>7s}{'ckpt s':>7s}{'eff s':>7s}{'start s':>8s}{'goodput':>9s}"
           f"{'ideal':>7s}{'model':>7s}"]
  for r in runs:
    eff = r["checkpoint_effective_seconds"]
    lines.append(
        f"{r['every']:>6d}{r['every'] * s['step_seconds']:>9.2f}{r['starts']:>7d}{r['kills']:>6d}"
        f"{r['wall_seconds']:>8.1f}{r['seconds']['train']:>8.1f}{r['seconds']['recompute']:>7.1f}"
        f"{r['checkpoint_blocking_seconds']:>7.3f}{eff if eff is not None else float('nan'):>7.3f}"
        f"{statistics.fmean([x for x in r['start_seconds'] if x] or [math.nan]):>8.1f}"
        f"{r['goodput']:>9.1%}{r['goodput_steps']:>7.1%}{r['predicted_goodput']:>7.1%}"
        + ("" if r["completed"] else f"  ({r['reason']})"))
  lines.append(
      f"step {s['step_seconds']:.3f} s, checkpoint cost C {s['checkpoint_seconds']:.3f} s "
      f"(blocking {s['checkpoint_blocking_seconds']:.3f} s), restart R {s['restart_seconds']:.1f} s "
      f"(first start {s['first_start_seconds']:.1f} s),"
      f" MTBF {s['mtbf_seconds']:g} s ({s['kills']} kills, "
      f"{s['wall_per_kill_seconds']:.1f} s of wall time per kill)")
  lines.append(
      f"Young/Daly sqrt(2 C M) = {s['young_daly_seconds']:.2f} s = {s['young_daly_steps']:.1f} "
      f"steps; model optimum (with R) {s['model_optimum_seconds']:.2f} s = "
      f"{s['model_optimum_steps']:.1f} steps; best measured: every {s['best_measured_every']} steps")
  return "\n".join(lines)


def plot(runs: list[dict], s: dict, path_stem: str) -> str:
  """Measured goodput per interval, the model's curve and the Young/Daly interval."""
  xs = [s["step_seconds"] * 1.05 ** k for k in range(-20, 200)]
  marks = [r["every"] for r in runs] + [s["young_daly_steps"], s["model_optimum_steps"]]
  lo, hi = min(marks) / 3, max(marks) * 3
  xs = [x for x in xs if lo <= x / s["step_seconds"] <= hi]
  model = [predicted_goodput(x, s) for x in xs]
  steps = [x / s["step_seconds"] for x in xs]
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:  # no matplotlib: a bare SVG with the same three elements
    return _svg(runs, s, steps, model, path_stem + ".svg")
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  ax.plot(steps, model, label=f"model: C={s['checkpoint_seconds']:.2f}s, R={s['restart_seconds']:.1f}"
          f"s (first {s['first_start_seconds']:.0f}s), M={s['mtbf_seconds']:g}s")
  ax.plot([r["every"] for r in runs], [r["goodput"] for r in runs], "o", label="measured")
  ax.axvline(s["young_daly_steps"], ls="--", c="gray", label="Young/Daly sqrt(2CM)")
  ax.axvline(s["model_optimum_steps"], ls=":", c="C0", label="model optimum")
  ax.set(xscale="log", xlabel="checkpoint interval (steps)", ylabel="goodput",
         title="Chaos soak: goodput vs checkpoint interval")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path_stem + ".png", dpi=120)
  plt.close(fig)
  return path_stem + ".png"


def _svg(runs, s, steps, model, path):
  w, h, pad = 480, 300, 40
  lx0, lx1 = math.log(steps[0]), math.log(steps[-1])
  top = max(model + [r["goodput"] for r in runs]) * 1.1 or 1.0
  x = lambda v: pad + (math.log(v) - lx0) / (lx1 - lx0) * (w - 2 * pad)
  y = lambda v: h - pad - v / top * (h - 2 * pad)
  curve = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in zip(steps, model))
  dots = "".join(f'<circle cx="{x(r["every"]):.1f}" cy="{y(r["goodput"]):.1f}" r="4"/>'
                 for r in runs)
  yd = x(min(max(s["young_daly_steps"], steps[0]), steps[-1]))
  with open(path, "w") as f:
    f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
            f'<polyline fill="none" stroke="blue" points="{curve}"/>{dots}'
            f'<line x1="{yd:.1f}" x2="{yd:.1f}" y1="{pad}" y2="{h - pad}" stroke="gray" '
            f'stroke-dasharray="4"/><text x="{pad}" y="20">goodput vs checkpoint interval '
            f'(steps, log); dashed: Young/Daly</text></svg>')
  return path


def main(argv=None) -> dict:
  from absl import flags
  from ml_collections import config_flags
  argv = sys.argv[1:] if argv is None else list(argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_dict("config", chaos_config.get_config(), flag_values=fv,
                                  lock_config=True,
                                  sys_argv=["chaos"] + argv)
  flags.DEFINE_string("workdir", None, "where the runs, chaos.json and the plot go",
                      flag_values=fv)
  flags.DEFINE_bool("analyse_only", False, "recompute chaos.json and the plot from the runs "
                    "already in --workdir", flag_values=fv)
  fv(["chaos"] + argv)
  config, workdir = fv["config"].value, fv["workdir"].value
  if not workdir:
    raise SystemExit("chaos: --workdir is required")
  chaos = config.chaos
  # Training overrides go to every start unchanged; `chaos.*` stays here.
  passed = [a for a in argv if a.startswith("--config.") and not a.startswith("--config.chaos.")]
  runs = []
  if fv["analyse_only"].value:
    with open(os.path.join(workdir, "chaos.json")) as f:
      saved = json.load(f)
    config, chaos = ConfigDict(saved["config"]), ConfigDict(saved["config"]["chaos"])
    for run in saved["runs"]:
      run.update(measure(os.path.join(workdir, f"every_{run['every']}"), run["every"], config))
      runs.append(run)
  for every in [] if runs else chaos.checkpoint_intervals:
    run_dir = os.path.abspath(os.path.join(workdir, f"every_{every}"))
    if os.path.exists(run_dir) and os.listdir(run_dir):
      raise SystemExit(f"chaos: {run_dir} is not empty; use a new --workdir")
    cmd = [sys.executable, "-m", "cli.main", "train", "--config", os.path.abspath(chaos_config.__file__),
           "--workdir", run_dir, *passed, f"--config.checkpoint_every={every}"]
    env = dict(os.environ, PYTHONPATH=REPO)
    if chaos.compilation_cache:
      env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(run_dir, "jax_cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    print(f"chaos: every {every} steps, MTBF {chaos.mtbf_seconds:g} s: {' '.join(cmd)}",
          flush=True)
    run = run_with_failures(cmd, run_dir, chaos, env, random.Random(chaos.seed))
    run.update(every=int(every), **measure(run_dir, int(every), config))
    run["goodput"] = run["seconds"]["train"] / run["wall_seconds"]
    print(f"chaos: every {every}: {run['starts']} starts, {run['kills']} kills, "
          f"{run['wall_seconds']:.1f} s, goodput {run['goodput']:.1%}", flush=True)
    runs.append(run)
  summary = analyse(runs, chaos, int(config.steps))
  table = format_table(runs, summary)
  print(table)
  result = dict(config=config.to_dict(), runs=runs, summary=summary, table=table)
  result["plot"] = plot(runs, summary, os.path.join(workdir, "chaos"))
  with open(os.path.join(workdir, "chaos.json"), "w") as f:
    json.dump(result, f, indent=1, default=float)
  return result


if __name__ == "__main__":
  main()
