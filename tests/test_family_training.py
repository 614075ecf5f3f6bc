"""Each decoder family, loaded from a Hugging Face directory (benchmarks/family_parity.py's
random tiny models), trains as a user runs it, `config.init_from` the directory, the loss
falling over 20 steps: the dense families through supervised fine-tuning, the mixture-of-experts
ones through language-model training (train.loop.train's own task), and every family through
DPO with LoRA adapters (align's tasks on the shared loop, which apply an MoE policy's router
losses as language-model training does)."""

import json
import os

import numpy as np
import pytest

import deps

deps.require("torch")
deps.require("transformers")

from align.dpo import DPOTask  # noqa: E402
from align.sft import SFTTask  # noqa: E402
from benchmarks.family_parity import FAMILIES, VOCAB, make_family  # noqa: E402
from experiments.hh_tiny import get_config  # noqa: E402
from train.loop import train  # noqa: E402

STEPS = 20
# A turn is "<s> role content</s>": the assistant's content and EOS follow the generation
# prompt exactly, as align/data.py needs to mask responses.
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s> assistant {% endif %}")


def words(rng, n):
  return " ".join(f"w{i}" for i in rng.integers(3, VOCAB, size=n))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """12 prompts, each with a response (SFT) and a chosen/rejected pair (DPO), in the families'
  word-level vocabulary."""
  rng = np.random.default_rng(0)
  folder = tmp_path_factory.mktemp("data")
  rows = [(words(rng, 6), words(rng, 8), words(rng, 8)) for _ in range(12)]
  paths = {"lm": folder / "text.jsonl", "sft": folder / "sft.jsonl",
           "dpo": folder / "pairs.jsonl"}
  with open(paths["lm"], "w") as f:
    f.writelines(json.dumps({"text": " ".join(row)}) + "\n" for row in rows)
  with open(paths["sft"], "w") as f:
    f.writelines(json.dumps({"prompt": p, "response": c}) + "\n" for p, c, _ in rows)
  with open(paths["dpo"], "w") as f:
    f.writelines(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n"
                 for p, c, r in rows)
  return paths


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param.replace(".", "_")))
  _, model, _ = make_family(request.param, directory, chat_template=TEMPLATE)
  return directory, model.cfg.is_moe


def config(family_dir, path, lr):
  c = get_config()
  c.init_from, c.data.path, c.data.val_fraction = family_dir, str(path), 0.25
  c.data.text_key = "text"  # language-model training reads {"text": ...}; hh_tiny says "chosen"
  c.steps, c.batch_size, c.seq_len = STEPS, 4, 40
  c.log_every, c.eval_every, c.eval_batches, c.checkpoint_every = 1, STEPS, 2, STEPS
  c.optimizer.lr, c.optimizer.warmup_steps = lr, 2
  c.watchdog.min_seconds = 1e6
  return c


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.mark.parametrize("task", ["train", "dpo"])
def test_the_loss_falls_over_20_steps(family_dir, data, tmp_path, task):
  """"train": SFT (its loss the language model's, on the responses), or for an MoE family
  language-model training itself; "dpo": DPO, which an MoE family is refused, by name."""
  directory, is_moe = family_dir
  kind = "dpo" if task == "dpo" else "lm" if is_moe else "sft"
  c = config(directory, data[kind], 1e-3 if kind == "dpo" else 3e-3)
  workdir = str(tmp_path / kind)
  tasks = {"lm": None, "sft": SFTTask, "dpo": DPOTask}
  if kind == "dpo":  # LoRA adapters (rank 4) on the frozen family: LoRA and DPO in one run
    c.align.lora_rank = 4
  train(c, workdir, task=tasks[kind] and tasks[kind](c, workdir))
  seen = losses(workdir)
  assert len(seen) == STEPS and all(np.isfinite(seen))
  if is_moe:  # the router's losses were applied and logged, by DPO's step too
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [row for row in map(json.loads, f) if "loss" in row]
    assert all(row["moe/aux_loss"] > 0 for row in rows)
  # the mean of the last five below the first five: training moved, not one lucky batch
  assert np.mean(seen[-5:]) < np.mean(seen[:5]), seen
