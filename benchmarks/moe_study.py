"""MoE vs dense on Tiny Shakespeare, and load balancing with and without the auxiliary loss.

Trains each variant of experiments/moe_study.py for the same steps on the
same tokens (same seed, data order and batch), then writes a table
(STUDY_DIR/study.md, study.json) and a plot of held-out loss and expert-load
imbalance per step:

  python -m benchmarks.moe_study --workdir runs/moe_study --plot docs/img/moe_study.png

Variants: `moe` (8 experts top-2, aux loss 0.05), `moe_no_aux` (aux weight 0),
`moe_bias` (auxiliary-loss-free balancing bias, aux weight 0) and `dense`
(one SwiGLU of mlp_dim 352 = top_k x expert width: the same active parameters
per token, without the 8x128 routers).
"""

import argparse
import itertools
import json
import os

import jax
import numpy as np

from experiments import moe_study
from train import global_data
from train.defaults import model_config_from
from train.loop import train
from train.workdir import load_trained


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(variant: str, workdir: str, config) -> dict:
  recs = _records(workdir)
  cfg = model_config_from(config)
  evals = [r for r in recs if "val_loss" in r]
  out = {"variant": variant, "steps": recs[-1]["step"],
         "tokens": recs[-1]["step"] * config.batch_size * config.seq_len,
         "active_params": cfg.num_params(active=True),
         "total_params": cfg.num_params(), "final_val_loss": evals[-1]["val_loss"],
         "final_train_loss": recs[-1]["loss"]}
  later = [r["moe/load_max_over_mean"] for r in recs
           if "moe/load_max_over_mean" in r and r["step"] >= moe_study.BALANCE_FROM_STEP]
  if later:
    out.update(load_max_over_mean_at_300=later[0], load_max_over_mean_after_300_max=max(later),
               load_max_over_mean_after_300_mean=sum(later) / len(later),
               final_aux_loss=recs[-1]["moe/aux_loss"],
               final_router_entropy=recs[-1]["moe/router_entropy"])
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    held = [heldout_load(workdir, config, s) for s in steps if s >= moe_study.BALANCE_FROM_STEP]
    out["heldout_load"] = held
    out["heldout_worst_layer_max_after_300"] = max(h["worst_layer"] for h in held)
  return out


def heldout_load(workdir: str, config, step: int | None = None, batches: int = 16) -> dict:
  """Per-layer max/mean expert load of a checkpoint over held-out batches (many tokens)."""
  model, tokenizer, step = load_trained(workdir, step)
  ds = global_data.make_global_dataset(config.data, tokenizer, seq_len=config.seq_len,
                                    global_batch_size=config.batch_size, split="validation",
                                    seed=config.seed)
  fn = jax.jit(lambda b: model(b["inputs"], b["positions"], b["segment_ids"],
                               return_stats=True)[1]["load"])
  load_LE = sum(np.asarray(fn(b)) for b in itertools.islice(iter(ds), batches))
  ratio_L = load_LE.max(-1) / load_LE.mean(-1)
  return {"step": step, "per_layer": [round(float(r), 4) for r in ratio_L],
          "worst_layer": float(ratio_L.max()),
          "layers_summed": float(load_LE.sum(0).max() / load_LE.sum(0).mean())}


def plot(rows, workdirs, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for row in rows:
    recs = _records(workdirs[row["variant"]])
    ev = [r for r in recs if "val_loss" in r]
    ax1.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], marker="o", ms=3,
             label=row["variant"])
    lo = [r for r in recs if "moe/load_max_over_mean" in r]
    if lo:
      ax2.plot([r["step"] for r in lo], [r["moe/load_max_over_mean"] for r in lo],
               label=row["variant"])
  ax1.set(xlabel="step", ylabel="held-out loss", title="Tiny Shakespeare, equal active params")
  ax1.set_ylim(top=min(ax1.get_ylim()[1], 6.0))
  ax2.axhline(1.3, color="gray", ls="--", lw=1)
  ax2.set(xlabel="step", ylabel="max / mean expert load (worst layer)", title="Expert load")
  for ax in (ax1, ax2):
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)


def table(rows) -> str:
  lines = ["| variant | active params | total params | steps | tokens | final held-out loss | "
           "held-out max/mean load, worst layer, at steps ≥300 | "
           "training batches, steps ≥300: mean / max |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    load = ("-", "-")
    if "heldout_load" in r:
      load = (", ".join(f"{h['step']}: {h['worst_layer']:.3f}" for h in r["heldout_load"]),
              f"{r['load_max_over_mean_after_300_mean']:.3f} / "
              f"{r['load_max_over_mean_after_300_max']:.3f}")
    lines.append(f"| {r['variant']} | {r['active_params']:,} | {r['total_params']:,} | "
                 f"{r['steps']} | {r['tokens']:,} | {r['final_val_loss']:.4f} | {load[0]} | "
                 f"{load[1]} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--variants", default=",".join(moe_study.VARIANTS))
  parser.add_argument("--steps", type=int, default=0, help="0: the config's 600")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default="")
  args = parser.parse_args()
  rows, workdirs = [], {}
  for variant in args.variants.split(","):
    config = moe_study.get_config(variant)
    config.seed = args.seed
    if args.steps:
      config.steps = args.steps
    workdirs[variant] = os.path.join(args.workdir, variant)
    train(config, workdirs[variant])  # resumes if already (partly) done
    rows.append(summarize(variant, workdirs[variant], config))
  with open(os.path.join(args.workdir, "study.json"), "w") as f:
    json.dump(rows, f, indent=2)
  md = table(rows)
  with open(os.path.join(args.workdir, "study.md"), "w") as f:
    f.write(md + "\n")
  if args.plot:
    plot(rows, workdirs, args.plot)
  print(md)


if __name__ == "__main__":
  main()
