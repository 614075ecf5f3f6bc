"""Distil SmolLM2-135M-Instruct into a 17M-parameter student (7.8x smaller, same tokenizer)
on real instruction text: the chosen transcripts of hh-rlhf helpful-base (decontaminated:
hh_tiny.HH), 10% of the conversation openings held out. `:hard` trains the same student on
hard labels alone.

  meshlm distill --config experiments/distill_smollm2.py --workdir runs/distill_kd
  meshlm distill --config experiments/distill_smollm2.py:hard --workdir runs/distill_hard
  python benchmarks/distill_speculative.py --json   (acceptance rate as a draft for SmolLM2)

Held-out metrics at the end: val_top1_agreement (student argmax = teacher argmax) and
val_ppl (the student's perplexity on the real text).
"""

from train.defaults import base_config
from experiments.hh_tiny import HH
from models.pretrained import smollm_path


def get_config(mode: str = "kd"):
  if mode not in ("kd", "hard"):
    raise ValueError(f"distill_smollm2 mode {mode!r}: choose 'kd' or 'hard'")
  c = base_config()
  c.steps = 300
  c.batch_size = 8
  c.seq_len = 128
  c.log_every = 25
  c.eval_every = 300
  c.eval_batches = 1000     # the whole held-out split
  c.checkpoint_every = 100

  c.tokenizer.path = (smollm_path() or "")   # the teacher's tokenizer
  c.model.vocab_size = 49152
  c.model.d_model = 256
  c.model.num_layers = 6
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.mlp_dim = 768
  c.model.max_seq_len = 2048
  c.model.tie_embeddings = True

  c.data.path = HH
  c.data.val_fraction = 0.1

  c.align.distill.teacher = (smollm_path() or "")
  c.align.distill.temperature = 2.0
  c.align.distill.alpha = 0.5 if mode == "kd" else 0.0

  c.optimizer.lr = 2e-3
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.0
  return c
