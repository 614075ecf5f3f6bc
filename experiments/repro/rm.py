"""Reward model as in InstructGPT (Ouyang et al. 2022, "Training language models to follow
instructions with human feedback", Section 3.5 and Appendix C.2): the 6B GPT-3 decoder with
its unembedding replaced by a scalar head, trained on the pairwise Bradley–Terry loss
-log σ(r(x, y_w) - r(x, y_l)) for one epoch: lr 9e-6 decayed by a cosine to 10% of it, batch
64, Adam β = (0.9, 0.95), a 2k-token context.

Paper scale, 16 devices (two 8-device hosts, FSDP). A pair step forwards 2 x batch_size rows,
so plan 128 rows:

  meshlm plan --config experiments/repro/rm.py --devices 16 --budget_gb 80 --compile \\
      --config.batch_size=128
  meshlm rm --config experiments/repro/rm.py --workdir runs/repro/rm \\
      --config.init_from=SFT_WORKDIR [--config.data.path=HH_RLHF_TRAIN_FILES]

`steps` = 519 is InstructGPT's one epoch (33,207 comparison prompts / 64); set it to one
epoch of the data given (the bundled split's 3,899 train records: 60 steps).

:smollm2, SmolLM2-135M-Instruct fully fine-tuned (so that PPO can score with it, `rm:WORKDIR`),
on one CPU in under an hour (docs/alignment.md has the measured step time):

  meshlm rm --config experiments/repro/rm.py:smollm2 --workdir runs/repro/rm_smollm2

Data (both variants): the hh-rlhf helpful pairs of common.HH_PAIRS, held out by the hash of
each conversation's first user turn (common.HH_VAL_FRACTION); held out, val_accuracy with its
95% Wilson interval. Not reproduced: InstructGPT's labeler data, its K = 4..9 ranked
completions per prompt (all C(K, 2) comparisons of a prompt in one batch element; hh-rlhf has
one pair per prompt, so the batch is 64 pairs), and the reward's shift so that labeler
demonstrations score 0 on average before RL.
"""

from experiments.repro import common


def get_config(variant: str = "paper"):
  c = common.base("rm", variant)
  common.hh_pairs(c)
  c.align.rm.center_coef = 0.0   # the paper's loss has no centring term
  o = c.optimizer
  o.lr, o.min_lr_ratio, o.b1, o.b2 = 9e-6, 0.1, 0.9, 0.95  # cosine to 10% (Appendix C.2)
  o.weight_decay = 0.0
  if variant == "paper":
    common.gpt3(c, **common.GPT3_6B)
    common.pod(c)
    c.steps, c.batch_size, c.seq_len = 519, 64, 2048
    c.checkpoint_every = 260    # ~20 min a run: `meshlm plan` rates saves every 100 as waste
    o.warmup_steps = 0          # the paper names no warmup
    c.eval_batches = 1000       # the whole held-out split
    return c
  # One CPU: one epoch as in the paper, 8 pairs a step at 128 tokens (the 2,209 train pairs
  # that fit); the whole held-out split (584 pairs) at the end.
  common.smollm2(c, steps=276)
  c.batch_size, c.seq_len = 8, 128
  c.eval_batches = 1000
  c.align.rm.head_std = 0.02    # a non-zero head, so the trunk gets gradients from step 1
  # 9e-6 moves a 135M model too little in 276 steps; 2e-5 and 5e-5 both reach ~61% held out
  o.lr, o.warmup_steps = 5e-5, 5
  return c
