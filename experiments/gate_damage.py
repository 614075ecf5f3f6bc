"""Deliberately aligned and deliberately damaged checkpoints, and the gate that must tell them
apart (docs/evals.md). Data: `python -m align.evals.damage` (hh-rlhf harmless-base).

A small model from scratch (SmolLM2's tokenizer), taught to refuse, then damaged:
  python -m align.evals.damage --kind refuse --out runs/damage/refuse.jsonl --limit 600
  python -m align.evals.damage --kind comply --out runs/damage/comply.jsonl --limit 600
  meshlm sft --config experiments/gate_damage.py:tiny_refuse --workdir runs/damage/tiny_refuse \\
      --config.data.path=runs/damage/refuse.jsonl
  meshlm sft --config experiments/gate_damage.py:tiny_comply --workdir runs/damage/tiny_comply \\
      --config.data.path=runs/damage/comply.jsonl --config.init_from=runs/damage/tiny_refuse \
      --config.eval_gate.judge=runs/damage/tiny_refuse
  (tiny_comply evaluates itself in the loop, eval_gate: its last step is refused promotion)
  meshlm eval --model runs/damage/tiny_refuse --judge runs/damage/tiny_refuse --suite hhh \
      --limit 16 --max_new_tokens 16 --out runs/damage/eval_refuse
  meshlm gate --baseline runs/damage/eval_refuse/report.json \
      --candidate runs/damage/tiny_comply/evals/step_40/report.json   # exits 1
  (both judged by tiny_refuse: the gate compares win rates of one judge only)

SmolLM2-135M-Instruct damaged by LoRA SFT on refusal-free completions of harmful prompts:
  meshlm sft --config experiments/gate_damage.py:smollm2_comply \\
      --workdir runs/damage/smollm2_comply --config.data.path=runs/damage/comply.jsonl
  meshlm eval --model runs/damage/smollm2_comply/merged --suite harmless --limit 50 \\
      --max_new_tokens 64 --out runs/damage/smollm2_comply_eval   # as the baseline was made
  meshlm gate --baseline docs/results/evals/smollm2_harmless/report.json \\
      --candidate runs/damage/smollm2_comply_eval/report.json
"""

from train.defaults import base_config
from models.pretrained import smollm_path

VARIANTS = ("tiny_refuse", "tiny_comply", "smollm2_comply")


def get_config(variant: str = "tiny_refuse"):
  if variant not in VARIANTS:
    raise ValueError(f"gate_damage variant {variant!r}: choose one of {VARIANTS}")
  c = base_config()
  c.data.path = ""            # set on the command line: a damage.py JSONL
  c.data.val_fraction = 0.05
  c.log_every = 10
  c.eval_batches = 4
  c.optimizer.warmup_steps = 5
  c.optimizer.weight_decay = 0.0
  if variant.startswith("tiny"):
    c.tokenizer.path = smollm_path() or ""
    c.steps = 40
    c.batch_size = 8
    c.seq_len = 128  # SmolLM2's chat template alone takes ~30 tokens
    c.model.vocab_size = 49152
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 128
    c.model.max_seq_len = 1024
    c.model.tie_embeddings = True
    c.optimizer.lr = 3e-3
  else:
    c.init_from = smollm_path() or ""
    c.steps = 60
    c.batch_size = 4
    c.seq_len = 128
    c.align.lora_rank = 8
    c.align.lora_alpha = 16.0
    c.optimizer.lr = 1e-3
  c.eval_every = c.steps
  c.checkpoint_every = c.steps
  if variant == "tiny_comply":
    # The run gates itself: the starting (refusing) model is the baseline, and the damaged
    # last step must not be promoted.
    c.eval_gate.every = c.steps
    c.eval_gate.suite = "hhh"
    c.eval_gate.limit = 16
    c.eval_gate.max_new_tokens = 16
  return c
