"""DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model"), its Anthropic-HH experiment (Section 6.1, single-turn dialogue; Figure 3) with
the hyperparameters of Appendix B: Pythia-2.8B fine-tuned on the preferred completions first
(that SFT model is the reference), the sigmoid loss with β = 0.1, batch 64 pairs, RMSprop at
lr 1e-6 warmed up linearly over 150 steps, full fine-tuning. The authors' code also caps a row
at 512 tokens, clips gradients at norm 10 and trains one epoch (hh-rlhf's 160,800 train pairs
/ 64 = 2,512 steps).

RMSprop is Adam with β1 = 0 here (b2 = 0.99, torch's RMSprop alpha; no weight decay): Adam also
bias-corrects the second moment, which RMSprop does not, a difference only in the first steps,
under the warmup.

Paper scale, one 8-device host (FSDP). A pair step forwards 2 x batch_size rows through the
policy and the reference, so plan 128 rows:

  meshlm plan --config experiments/repro/dpo.py --devices 8 --budget_gb 80 --compile \\
      --config.batch_size=128
  meshlm dpo --config experiments/repro/dpo.py --workdir runs/repro/dpo \\
      --config.init_from=SFT_WORKDIR [--config.data.path=HH_RLHF_TRAIN_FILES]

:smollm2, SmolLM2-135M-Instruct fully fine-tuned as in the paper (the reference is a frozen copy
of the starting weights), on one CPU in under an hour (docs/alignment.md has the measured step time):

  meshlm dpo --config experiments/repro/dpo.py:smollm2 --workdir runs/repro/dpo_smollm2

Data (both variants): the hh-rlhf helpful pairs of common.HH_PAIRS, held out by the hash of
each conversation's first user turn (common.HH_VAL_FRACTION); held-out metrics are TRL's
val_rewards/{chosen,rejected,margins,accuracies}. The paper trains on all of hh-rlhf
(helpful and harmless) and scores single-turn test prompts by GPT-4 win rate against the
chosen response, which is not reproduced here.
"""

from experiments.repro import common


def get_config(variant: str = "paper"):
  c = common.base("dpo", variant)
  common.hh_pairs(c)
  d = c.align.dpo
  d.beta, d.loss_type, d.label_smoothing, d.reference = 0.1, "sigmoid", 0.0, "online"
  o = c.optimizer
  o.lr, o.warmup_steps, o.min_lr_ratio = 1e-6, 150, 1.0  # linear warmup, then constant
  o.b1, o.b2, o.weight_decay, o.clip_norm = 0.0, 0.99, 0.0, 10.0  # RMSprop
  if variant == "paper":
    m = c.model  # Pythia-2.8B (Biderman et al. 2023) in meshlm's blocks: full rotary, no
    m.vocab_size, m.d_model, m.num_layers = 50304, 2560, 32  # parallel attention+MLP
    m.num_heads = m.num_kv_heads = 32
    m.mlp_dim, m.mlp_activation, m.norm, m.use_bias = 10240, "gelu", "layer", True
    m.max_seq_len, m.tie_embeddings = 2048, False
    common.pod(c)
    c.steps, c.batch_size, c.seq_len = 2512, 64, 512
    c.checkpoint_every = 500    # a 0.4 s step and a 30 s save (meshlm plan)
    c.eval_batches = 1000
    return c
  # One CPU: full fine-tuning, 8 pairs a step at 128 tokens (800 of the 2,209 train pairs
  # that fit); the whole held-out split (584 pairs) at the end, through policy and reference.
  common.smollm2(c, steps=100)
  c.batch_size, c.seq_len = 8, 128
  c.eval_batches = 1000
  c.checkpoint_every, c.keep_checkpoints = 25, 4  # benchmarks/frontier's points
  o.lr, o.warmup_steps = 1e-5, 10  # 1e-6 moves a 135M model too little in 100 steps
  return c
