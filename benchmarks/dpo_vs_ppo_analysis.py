"""The analysis of benchmarks/dpo_vs_ppo.py's runs: Pareto frontiers of reward against
KL(pi || pi_ref), which method dominates at matched KL, compute to reach a reward, the
markdown table and the plot."""

import os

import numpy as np

from benchmarks.common import log


def pareto(points: list[tuple]) -> list[tuple]:
  """The (kl, reward) points no other beats on both lower KL and higher reward, by KL."""
  front, best = [], -np.inf
  for kl, r in sorted(points, key=lambda p: (p[0], -p[1])):
    if r > best:
      front.append((kl, r))
      best = r
  return front


def frontier_at(front: list[tuple], kl: float) -> float:
  """The frontier's reward at `kl`: linear between its points, flat past the last."""
  ks, rs = zip(*front)
  return float(np.interp(kl, ks, rs))


def to_reward(runs: list[dict], threshold: float, key: str) -> float | None:
  """Least `key` (flops, wall_s) any run needs to first reach `threshold` (linear between
  its evaluated checkpoints); None if none does."""
  best = None
  for run in runs:
    prev = None
    for p in run["points"]:
      if p["reward"] >= threshold:
        x = p[key]
        if prev is not None and p["reward"] > prev["reward"]:
          x = prev[key] + (p[key] - prev[key]) * (threshold - prev["reward"]) / (
              p["reward"] - prev["reward"])
        best = x if best is None else min(best, x)
        break
      prev = p
  return best


def analyse(runs: list[dict], ref: dict, grid: int = 25,
            compute_keys: tuple = ("flops", "wall_s")) -> dict:
  """Frontier comparison at matched KL and compute (each of `compute_keys`, a key of every
  point) to reward thresholds, DPO vs PPO."""
  pts = {m: [(p["kl"], p["reward"]) for r in runs if r["method"] == m for p in r["points"]]
         for m in ("dpo", "ppo")}
  fronts = {m: pareto(v) for m, v in pts.items()}
  # Matched KL: the range both frontiers cover; within 2 standard errors counts as a tie.
  hi = min(fronts["dpo"][-1][0], fronts["ppo"][-1][0])
  tol = 2 * float(np.mean([p["reward_se"] for r in runs for p in r["points"]]))
  kls = np.linspace(0.0, max(hi, 0.0), grid)
  diff = np.asarray([frontier_at(fronts["dpo"], k) - frontier_at(fronts["ppo"], k) for k in kls])
  if np.all(np.abs(diff) <= tol):
    verdict = "tie"
  elif np.all(diff >= -tol):
    verdict = "dpo"
  elif np.all(diff <= tol):
    verdict = "ppo"
  else:
    verdict = "mixed"
  ahead = {m: float(np.mean(sign * diff > tol)) for m, sign in (("dpo", 1), ("ppo", -1))}
  lead = {"dpo": float(max(diff.max(), 0.0)), "ppo": float(max(-diff.min(), 0.0))}
  best = {m: max(r for _, r in v) for m, v in pts.items()}
  common = min(best.values())
  out = {"frontier": {"pareto": {m: [list(p) for p in f] for m, f in fronts.items()},
                      "matched_kl_max": hi, "tolerance": tol, "kl_grid": kls.tolist(),
                      "dpo_minus_ppo": diff.tolist(), "mean_dpo_minus_ppo": float(diff.mean()),
                      "dominates": verdict, "ahead_fraction": ahead, "max_lead": lead,
                      "best_reward": best}}
  targets = []
  for name, frac in (("half_gain", 0.5), ("common_best", 1.0)):
    thr = ref["reward"] + frac * (common - ref["reward"])
    row = {"name": name, "reward": thr}
    if common <= ref["reward"] + tol:  # not a gain over pi_ref: nothing to compare
      targets.append({**row, **{f"{m}_{k}": None for m in ("dpo", "ppo", "ppo_over_dpo")
                                for k in compute_keys}})
      continue
    for key in compute_keys:
      for m in ("dpo", "ppo"):
        row[f"{m}_{key}"] = to_reward([r for r in runs if r["method"] == m], thr, key)
      d, p = row[f"dpo_{key}"], row[f"ppo_{key}"]
      row[f"ppo_over_dpo_{key}"] = p / d if d and p else None
    targets.append(row)
  out["compute_to_reward"] = targets
  return out


def table(doc: dict) -> str:
  """Markdown: a row per run (its last checkpoint and its best), then the summary."""
  g = lambda x: "-" if x is None else f"{x / 1e9:.2f}"
  lines = ["| method | beta / kl_coef | steps | reward (final) | KL (final) | length | best reward (KL) "
           "| GFLOPs | wall s |", "|---|---|---|---|---|---|---|---|---|"]
  ref = doc["ref"]
  lines.append(f"| pi_ref | - | 0 | {ref['reward']:.4f} ± {ref['reward_se']:.4f} | 0 | "
               f"{ref['length']:.1f} | - | 0 | 0 |")
  for r in doc["runs"]:
    last = r["points"][-1]
    top = max(r["points"], key=lambda p: p["reward"])
    lines.append(f"| {r['method'].upper()} | {r['coef']} | {last['step']} | {last['reward']:.4f}"
                 f" ± {last['reward_se']:.4f} | {last['kl']:.2f} ± {last['kl_se']:.2f} | "
                 f"{last['length']:.1f} | "
                 f"{top['reward']:.4f} ({top['kl']:.2f}) | {g(last['flops'])} | "
                 f"{last['wall_s']:.0f} |")
  f = doc["frontier"]
  lines += ["", f"Frontier at matched KL (0 to {f['matched_kl_max']:.2f} nats): dominates = "
            f"**{f['dominates']}** (mean DPO - PPO reward {f['mean_dpo_minus_ppo']:+.4f}, tie "
            f"tolerance {f['tolerance']:.4f}); DPO ahead on {f['ahead_fraction']['dpo']:.0%} of "
            f"it (by at most {f['max_lead']['dpo']:.4f}), PPO on {f['ahead_fraction']['ppo']:.0%} "
            f"(by at most {f['max_lead']['ppo']:.4f}).", "",
            "| reward threshold | DPO GFLOPs | PPO GFLOPs | PPO / DPO FLOPs | DPO wall s | "
            "PPO wall s | PPO / DPO wall |", "|---|---|---|---|---|---|---|"]
  ratio = lambda x: "-" if x is None else f"{x:.2f}x"
  sec = lambda x: "-" if x is None else f"{x:.0f}"
  for t in doc["compute_to_reward"]:
    lines.append(f"| {t['name']} {t['reward']:.4f} | {g(t['dpo_flops'])} | {g(t['ppo_flops'])} | "
                 f"{ratio(t['ppo_over_dpo_flops'])} | {sec(t['dpo_wall_s'])} | "
                 f"{sec(t['ppo_wall_s'])} | {ratio(t['ppo_over_dpo_wall_s'])} |")
  return "\n".join(lines)


def plot(doc: dict, path: str) -> str | None:
  """Reward vs KL (each run's checkpoints, both frontiers) and reward vs training FLOPs."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("dpo_vs_ppo: matplotlib not installed; no plot")
    return None
  fig, (ax_kl, ax_c) = plt.subplots(1, 2, figsize=(12, 4.8))
  colors = {"dpo": plt.cm.Blues, "ppo": plt.cm.Reds}
  for m in ("dpo", "ppo"):
    mine = [r for r in doc["runs"] if r["method"] == m]
    for i, r in enumerate(mine):
      c = colors[m](0.45 + 0.5 * i / max(len(mine) - 1, 1))
      label = f"{m.upper()} {'beta' if m == 'dpo' else 'kl_coef'}={r['coef']}"
      pts = r["points"]
      ax_kl.plot([p["kl"] for p in pts], [p["reward"] for p in pts], "o-", ms=3, color=c,
                 label=label)
      ax_c.plot([p["flops"] / 1e9 for p in pts], [p["reward"] for p in pts], "o-", ms=3,
                color=c, label=label)
    front = doc["frontier"]["pareto"][m]
    ax_kl.plot(*zip(*front), "--", lw=2, color=colors[m](0.95), label=f"{m.upper()} frontier")
  for t in doc["compute_to_reward"]:
    ax_c.axhline(t["reward"], color="gray", lw=0.8, ls=":")
  ax_kl.set(xlabel="KL(pi || pi_ref), nats per completion", ylabel="reward (share of 'e')",
            title="reward vs KL (held-out prompts)")
  ax_c.set(xlabel="training compute, GFLOPs (DPO includes sampling its pairs)",
           ylabel="reward", title="reward vs compute")
  ax_kl.legend(fontsize=7)
  ax_c.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  return path


