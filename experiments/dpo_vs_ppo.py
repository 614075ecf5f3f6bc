"""DPO vs PPO on one programmatic reward: reward against KL(pi || pi_ref), and compute to a reward.

Controlled task: continue the first few words of a Tiny Shakespeare line; the reward is the
share of 'e' characters in the completion (align/rewards.py "letter:e"), known exactly, so
neither method is limited by a learned reward model and the only trade-off is against KL.

  ref   a tiny LM pretrained on Tiny Shakespeare (the SFT/reference policy pi_ref)
  ppo   PPO from ref (align/ppo.py), text prompts, temperature 1, fixed kl_coef (swept)
  dpo   DPO from ref (align/dpo.py) on pairs of two pi_ref samples per train prompt, the
        higher-reward one chosen (ties dropped), token-level (benchmarks/dpo_vs_ppo.py writes
        them straight into the task, so prompts and completions are the exact tokens PPO sees)

  python benchmarks/dpo_vs_ppo.py --json > /tmp/dpo_vs_ppo.json   # everything, ~7 min, 2 CPUs
  python benchmarks/dpo_vs_ppo.py --quick --json                  # tiny smoke run
  meshlm train --config experiments/dpo_vs_ppo.py:ref --workdir runs/dpo_vs_ppo/ref   # ref only

The ppo/dpo configs need `init_from` (the ref workdir) and prompt files, which the driver sets.
"""

from train.data_root import data_path
from train.defaults import base_config

SHAKESPEARE = data_path("tinyshakespeare", "input.txt")
KINDS = ("ref", "ppo", "dpo")

# The sweep and the shared evaluation (benchmarks/dpo_vs_ppo.py reads these).
REWARD = "letter:e"
PROMPT_WORDS = 4          # a prompt: the first words of a line of at least PROMPT_WORDS + 2
TRAIN_PROMPTS = 512       # DPO: two pi_ref samples each -> pairs; PPO: its prompt pool
EVAL_PROMPTS = 128        # held out from both; EVAL_SAMPLES completions each, fixed seeds
EVAL_SAMPLES = 2
MAX_NEW_TOKENS = 24
DPO_BETAS = (0.03, 0.1, 0.3, 1.0)
PPO_KL_COEFS = (0.003, 0.01, 0.03)
DPO_STEPS, DPO_EVAL_EVERY = 96, 12    # 16 pairs a step: ~3 epochs over the pairs
PPO_STEPS, PPO_EVAL_EVERY = 96, 12    # 32 completions a step


def get_config(kind: str = "ref"):
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}; choose one of {KINDS}")
  c = base_config()
  c.seq_len = 64
  c.log_every = 8
  c.eval_batches = 1
  c.peak_flops_per_device = 1e11  # MFU is not reported here: skip the CPU peak measurement
  c.async_checkpoints = False
  if kind == "ref":
    c.steps = 1500            # ~1 min on 2 CPU cores; val loss ~2.9 (vocab 512)
    c.batch_size = 16
    c.eval_every = 500
    c.checkpoint_every = 1500
    c.model.vocab_size = 512
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 176
    c.model.max_seq_len = 128
    c.model.tie_embeddings = True
    c.tokenizer.train_vocab_size = 512
    c.data.path = SHAKESPEARE
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.weight_decay = 0.0
    c.sample.prompt = "ROMEO:"
    c.sample.max_new_tokens = 48
    return c

  # Fine-tuning from the ref: the same optimizer for both, a short warmup, constant-ish lr.
  c.optimizer.lr = 5e-4
  c.optimizer.warmup_steps = 4
  c.optimizer.min_lr_ratio = 1.0
  c.optimizer.weight_decay = 0.0
  c.keep_checkpoints = 1000
  c.data.doc_separator = "\n"    # prompt files: one prompt a line
  c.data.val_fraction = 0.0
  if kind == "dpo":
    c.steps, c.batch_size = DPO_STEPS, 16
    c.checkpoint_every = c.keep_checkpoint_every = DPO_EVAL_EVERY
    c.eval_every = DPO_STEPS
    c.align.dpo.beta = DPO_BETAS[1]
    c.align.dpo.reference = "cached"  # pi_ref's logps once per pair, as TRL precomputes them
    return c
  c.steps, c.batch_size = PPO_STEPS, 32
  c.checkpoint_every = c.keep_checkpoint_every = PPO_EVAL_EVERY
  c.eval_every = PPO_STEPS
  p = c.align.ppo
  p.reward, p.prompts, p.temperature = REWARD, "text", 1.0  # sample pi itself, as DPO models
  p.max_new_tokens = MAX_NEW_TOKENS
  p.kl_coef, p.kl_estimator = PPO_KL_COEFS[1], "k1"
  p.epochs, p.minibatches = 2, 2
  return c
