"""Decoder-only vs encoder-decoder vs prefix-LM (hybrid) on one seq2seq task, equal params.

    python -m benchmarks.arch_compare --plot docs/img/arch_compare.png   # ~10 min, 2 CPU cores
    python -m benchmarks.arch_compare --quick                            # tiny smoke run

Each architecture of experiments/arch_compare.py is trained by train.loop.train (what
`meshlm train` runs) in a fresh workdir, with the same steps, tokenizer and examples, then
evaluated on the whole held-out split (train/seq2seq_data.py, reverse the words of a line):
  val_loss        teacher-forced cross-entropy per target token (eos included)
  token_accuracy  teacher-forced argmax == target, over the same tokens
  exact_match     greedy output up to its first eos == target + eos
Greedy decoding is an uncached full forward per generated token, identical for all three.
Training runs one architecture after another, so load from other processes on shared cores
skews `train_seconds`; the losses and accuracies do not depend on it.

One JSON document goes to stdout; progress goes to stderr.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import log
from experiments import arch_compare
from train.defaults import model_config_from
from models import param_count
from models.registry import model_inputs
from train import seq2seq_data
from train.loop import train
from train.step import token_losses
from train.workdir import load_trained

ARCHS = arch_compare.ARCHS
DECODE_ROWS = 128  # greedy decoding batch (fixed, so each architecture compiles once)


def quick_config(config):
  """Tiny sizes for a smoke run of the whole pipeline in seconds."""
  config.steps, config.log_every, config.eval_every, config.checkpoint_every = 4, 2, 4, 4
  config.peak_flops_per_device = 1e11  # skip the CPU peak measurement
  config.optimizer.warmup_steps = 2
  config.data.seq2seq.max_words = 4
  config.data.val_fraction = 0.05
  m = config.model
  m.d_model, m.num_heads, m.num_kv_heads, m.vocab_size = 32, 2, 1, 320
  m.mlp_dim = 48 if m.arch == "encoder_decoder" else 64
  config.tokenizer.train_vocab_size = 320
  return config


def teacher_forced(model, config, tokenizer) -> dict:
  """Loss and token accuracy over the whole validation split, in the training layout."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def sums(state, batch):
    m = nnx.merge(graphdef, state)
    logits_BTV = m(batch["inputs"], batch["positions"], batch["segment_ids"],
                   **model_inputs(m.cfg, batch))
    mask_BT = ((batch["segment_ids"] > 0) & (batch["loss_mask"] > 0)).astype(jnp.float32)
    correct_BT = (jnp.argmax(logits_BTV, -1) == batch["targets"]).astype(jnp.float32)
    return (jnp.sum(token_losses(logits_BTV, batch["targets"]) * mask_BT),
            jnp.sum(correct_BT * mask_BT), jnp.sum(mask_BT))

  ds = seq2seq_data.make_dataset(config.data, tokenizer, arch=model.cfg.arch,
                                 seq_len=config.seq_len, batch_size=config.batch_size,
                                 split="validation", seed=config.seed)
  total = np.zeros(3)
  for batch in ds:
    total += np.array([float(x) for x in sums(state, batch)])
  return {"val_loss": float(total[0] / total[2]), "token_accuracy": float(total[1] / total[2]),
          "target_tokens": int(total[2])}


def _prompt_rows(examples, arch: str, seq_len: int, source_len: int, sep_id: int):
  """Rows holding only what the model is given: (batch, index of the last given token)."""
  n = len(examples)
  batch = {"inputs": np.zeros((n, seq_len), np.int32),
           "positions": np.tile(np.arange(seq_len, dtype=np.int32), (n, 1)),
           # Segment 1 throughout: later cells are unseen under the causal mask anyway.
           "segment_ids": np.ones((n, seq_len), np.int32)}
  last_B = np.zeros(n, np.int32)
  if arch == "encoder_decoder":
    batch["enc_inputs"] = np.zeros((n, source_len), np.int32)
    batch["enc_segment_ids"] = np.zeros((n, source_len), np.int32)
    batch["enc_positions"] = np.tile(np.arange(source_len, dtype=np.int32), (n, 1))
  elif arch == "prefix_lm":
    batch["prefix"] = np.zeros((n, seq_len), np.int32)
  for b, (src, _) in enumerate(examples):
    if arch == "encoder_decoder":
      batch["enc_inputs"][b, :len(src)] = src
      batch["enc_segment_ids"][b, :len(src)] = 1
      batch["inputs"][b, 0] = sep_id
    else:
      batch["inputs"][b, :len(src) + 1] = np.append(src, sep_id)
      last_B[b] = len(src)
      if arch == "prefix_lm":
        batch["prefix"][b, :len(src) + 1] = 1
  return batch, last_B


def greedy_exact_match(model, config, tokenizer, examples) -> dict:
  """Share of examples whose greedy output up to its first eos is exactly target + eos.

  Examples go in length order, DECODE_ROWS at a time, in rows cut to the next power of two
  that holds the chunk: the answers do not change (causal), only the cost.
  """
  arch = model.cfg.arch
  sep_id, eos_id = seq2seq_data.special_ids(tokenizer)
  graphdef, state = nnx.split(model)

  @jax.jit
  def next_token(state, batch, last_B):
    m = nnx.merge(graphdef, state)
    logits_BTV = m(batch["inputs"], batch["positions"], batch["segment_ids"],
                   **model_inputs(m.cfg, batch))
    return jnp.argmax(jnp.take_along_axis(logits_BTV, last_B[:, None, None], axis=1)[:, 0], -1)

  need = [len(t) + 1 + (0 if arch == "encoder_decoder" else len(s)) for s, t in examples]
  order = sorted(range(len(examples)), key=need.__getitem__)
  outputs = {}
  for start in range(0, len(order), DECODE_ROWS):
    ids = order[start:start + DECODE_ROWS]
    chunk = [examples[i] for i in ids]
    padded = chunk + [chunk[0]] * (DECODE_ROWS - len(chunk))  # fixed shape; extras dropped
    width = min(config.seq_len, max(16, 1 << (max(need[i] for i in ids) - 1).bit_length()))
    batch, last_B = _prompt_rows(padded, arch, width, config.data.seq2seq.source_len, sep_id)
    steps = max(len(tgt) for _, tgt in chunk) + 1  # enough for every target and its eos
    out = np.zeros((DECODE_ROWS, steps), np.int32)
    for i in range(steps):
      out[:, i] = np.asarray(next_token(state, batch, last_B))
      last_B = np.minimum(last_B + 1, width - 1)
      batch["inputs"][np.arange(DECODE_ROWS), last_B] = out[:, i]
    for b, i in enumerate(ids):
      gen = list(out[b])
      outputs[i] = gen[:gen.index(eos_id) + 1] if eos_id in gen else gen
  hits = [outputs[i] == list(tgt) + [eos_id] for i, (_, tgt) in enumerate(examples)]
  samples = [{"source": tokenizer.decode(examples[i][0]), "output": tokenizer.decode(outputs[i]),
              "correct": hits[i]} for i in range(min(3, len(examples)))]
  return {"exact_match": sum(hits) / len(examples), "examples": len(examples),
          "samples": samples}


def _curve(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [{k: r[k] for k in ("step", "loss", "val_loss") if k in r} for r in records]


def run_arch(arch: str, args, root: str) -> dict:
  config = arch_compare.get_config(arch)
  if args.quick:
    quick_config(config)
  if args.steps:
    config.steps = config.checkpoint_every = args.steps
  config.model.tie_embeddings = args.tied
  config.seed = args.seed
  workdir = os.path.join(root, arch)
  log(f"arch_compare: training {arch} for {config.steps} steps in {workdir}")
  t = time.perf_counter()
  with contextlib.redirect_stdout(sys.stderr):  # the loop's log; stdout is for the JSON
    last = train(config, workdir)
  wall = time.perf_counter() - t
  with open(os.path.join(workdir, "goodput.json")) as f:
    seconds = json.load(f)["seconds"]
  model, tokenizer, _ = load_trained(workdir)
  examples = seq2seq_data.load_examples(config.data, tokenizer, "validation", arch=arch,
                                        seq_len=config.seq_len)
  t = time.perf_counter()
  result = {"params": param_count(model_config_from(config)), "steps": config.steps,
            "train_wall_seconds": round(wall, 1),
            "train_step_seconds": round(seconds["train"], 1),
            "compile_seconds": round(seconds["compile"], 1),
            "loop_final_val_loss": last["val_loss"],
            **teacher_forced(model, config, tokenizer),
            **greedy_exact_match(model, config, tokenizer, examples),
            "curve": _curve(workdir)}
  result["eval_seconds"] = round(time.perf_counter() - t, 1)
  log(f"arch_compare: {arch}: val_loss {result['val_loss']:.4f}, exact match "
      f"{result['exact_match']:.3f}, {wall:.0f}s")
  return result


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_loss, ax_em) = plt.subplots(1, 2, figsize=(10, 4))
  for arch, r in results.items():
    points = [(p["step"], p["val_loss"]) for p in r["curve"] if "val_loss" in p]
    ax_loss.plot(*zip(*points), marker="o", label=f"{arch} ({r['params']:,} params)")
  ax_loss.set(xlabel="step", ylabel="held-out loss per target token", yscale="log")
  ax_loss.legend()
  names = list(results)
  ax_em.bar(names, [100 * results[a]["exact_match"] for a in names])
  for i, a in enumerate(names):
    ax_em.text(i, 100 * results[a]["exact_match"], f"{100 * results[a]['exact_match']:.1f}%",
               ha="center", va="bottom")
  ax_em.set(ylabel="held-out exact match, greedy (%)", title="reverse the words of a line")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny models, a few steps")
  parser.add_argument("--steps", type=int, default=0, help="override config.steps")
  parser.add_argument("--archs", default=",".join(ARCHS))
  parser.add_argument("--seed", type=int, default=0, help="init and data order (config.seed)")
  parser.add_argument("--tied", action="store_true", help="tie the embeddings (the encoder-"
                      "decoder then scales its output by d_model**-0.5, as T5 does)")
  parser.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
  parser.add_argument("--plot", default="", help="save the figure here (needs matplotlib)")
  args = parser.parse_args(argv)
  if args.workdir:
    os.makedirs(args.workdir, exist_ok=True)
    if os.listdir(args.workdir):
      raise SystemExit(f"--workdir {args.workdir} is not empty: the runs would resume its "
                       "checkpoints instead of training from scratch")
  root = args.workdir or tempfile.mkdtemp(prefix="arch_compare-")
  try:
    results = {arch: run_arch(arch, args, root) for arch in args.archs.split(",")}
  finally:
    if not args.workdir:
      shutil.rmtree(root, ignore_errors=True)
  counts = [r["params"] for r in results.values()]
  out = {"task": "reverse_words", "quick": args.quick, "devices": str(jax.devices()[0]),
         "max_param_ratio": max(counts) / min(counts), "archs": results}
  if args.plot:
    plot(results, args.plot)
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
