"""A small model trained from scratch on hh-rlhf for every alignment command, in minutes on
one CPU: SFT on the chosen transcripts, then a reward model, DPO or LoRA on top.

  meshlm sft --config experiments/hh_tiny.py --workdir runs/hh_tiny_sft
  meshlm rm  --config experiments/hh_tiny.py --workdir runs/hh_tiny_rm \\
      --config.init_from=runs/hh_tiny_sft
  meshlm dpo --config experiments/hh_tiny.py --workdir runs/hh_tiny_dpo \\
      --config.init_from=runs/hh_tiny_sft [--config.align.lora_rank=8]

Data: data/hh-rlhf/helpful-base-test.jsonl.gz (Anthropic hh-rlhf, MIT) less its 144 rows
that share 13-grams with AlpacaEval (the asset helpful-base-test-decontam, data/hh-rlhf/
PROVENANCE.md), 5% of the conversation openings held out. The tokenizer is a byte-level BPE
trained on the chosen transcripts (a run with init_from takes that workdir's).
"""

from train.data_root import data_path
from train.defaults import base_config

# The decontaminated rows: the raw file holds AlpacaEval's helpful_base prompts.
HH = data_path("hh-rlhf", "helpful-base-test-decontam", "v1", "data.jsonl")


def get_config():
  c = base_config()
  c.steps = 300
  c.batch_size = 8
  c.seq_len = 128
  c.log_every = 20
  c.eval_every = 100
  c.eval_batches = 16
  c.checkpoint_every = 100

  c.model.vocab_size = 2048
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.mlp_dim = 352
  c.model.max_seq_len = 512
  c.model.tie_embeddings = True

  c.tokenizer.train_vocab_size = 2048
  c.data.path = HH
  c.data.text_key = "chosen"   # the tokenizer's training text
  c.data.val_fraction = 0.05

  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.0
  c.align.dpo.beta = 0.1
  return c
