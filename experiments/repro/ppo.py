"""PPO for RLHF with an adaptive KL penalty: InstructGPT's PPO (Ouyang et al. 2022, Appendix
C.4) with the KL controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", Section 2.2).

InstructGPT C.4: the 6B GPT-3 policy starts from the SFT model, which also gives the per-token
KL reward (β = 0.02); 256k episodes of batch 512, each batch split into 8 minibatches of 64 and
trained on for a single inner epoch; a constant learning rate after a warmup over the first 10
iterations; no discount in GAE (γ = 1; λ 0.95 as TRL, the paper gives none); clip ratio 0.2;
sampling temperature 1; a 2k-token context. The released policy's learning rate is not
printed: runs above 8.05e-6 diverged without the pretraining mix (E.9), so 8.05e-6.
Ziegler et al. 2.2: β adapts toward a target KL, e = clip(KL / KL_target - 1, ±0.2),
β ← β·(1 + e·batch / horizon), KL_target 6 nats and horizon 10,000 episodes (as their code,
openai/lm-human-preferences); it starts at InstructGPT's 0.02. --config.align.ppo.kl_target=0
keeps β fixed at 0.02, as InstructGPT.

Not reproduced: InstructGPT's separate 6B value model initialised from the reward model (here
a zero-initialised value head on the policy's trunk, vf_coef 0.1 and value clip 0.2 as TRL),
its weight EMA (0.992), PPO-ptx's pretraining mix, and its API prompts.

Paper scale, 64 devices (FSDP). The step updates on 64-row minibatches; plan the rollout's
512 rows (an upper bound):

  meshlm plan --config experiments/repro/ppo.py --devices 64 --budget_gb 80 --compile
  meshlm ppo --config experiments/repro/ppo.py --workdir runs/repro/ppo \\
      --config.init_from=SFT_WORKDIR --config.align.ppo.reward=rm:runs/repro/rm

Its prompts are the hh-rlhf conversations of common.HH_PAIRS (the turns before the last
answer), scored by the reward model of experiments/repro/rm.py.

:smollm2, SmolLM2-135M-Instruct with LoRA adapters (the reference is the base), on the
arithmetic word problems of data/arith scored by the `arith` reward, on one CPU in under an
hour (docs/alignment.md has the measured step time):

  meshlm ppo --config experiments/repro/ppo.py:smollm2 --workdir runs/repro/ppo_smollm2

or scored by a reward model instead (a full fine-tune with SmolLM2's tokenizer, such as
experiments/repro/rm.py:smollm2 writes), on its hh-rlhf prompts:

  meshlm ppo --config experiments/repro/ppo.py:smollm2_rm --workdir runs/repro/ppo_smollm2_rm \\
      [--config.align.ppo.reward=rm:runs/repro/rm_smollm2]
"""

from experiments.repro import common

RM_SMOLLM2 = "runs/repro/rm_smollm2"  # where rm.py:smollm2's docstring command writes


def get_config(variant: str = "paper"):
  rm = variant == "smollm2_rm"
  c = common.base("ppo", variant, more=("smollm2_rm",))
  p = c.align.ppo
  p.prompts, p.temperature = "chat", 1.0
  p.kl_coef, p.kl_estimator, p.kl_target, p.kl_horizon = 0.02, "k1", 6.0, 10000.0
  p.gamma, p.lam, p.whiten_advantages = 1.0, 0.95, True
  p.clip, p.value_clip, p.vf_coef, p.entropy_coef = 0.2, 0.2, 0.1, 0.0
  p.epochs, p.minibatches = 1, 8
  o = c.optimizer
  o.lr, o.warmup_steps, o.min_lr_ratio = 8.05e-6, 10, 1.0  # constant after 10 iterations
  o.b1, o.b2, o.weight_decay = 0.9, 0.95, 0.0
  if variant == "paper":
    common.gpt3(c, **common.GPT3_6B)
    common.pod(c)
    common.hh_pairs(c)
    c.steps, c.batch_size, c.seq_len = 500, 512, 2048   # 256k episodes
    p.max_new_tokens, p.reward = 1024, "rm:runs/repro/rm"
    c.eval_batches = 4
    return c
  # One CPU: LoRA, 8 rollouts a step (2 minibatches of 4), 48 new tokens.
  common.smollm2(c, steps=60)
  c.batch_size, c.seq_len = 8, 160
  c.eval_batches = 4            # 32 held-out prompts, one completion each
  c.checkpoint_every = 20       # benchmarks/frontier's points (the last 3 kept)
  p.max_new_tokens, p.minibatches = 48, 2
  # Ziegler's target is for 24-token continuations; the same nats per token here.
  p.kl_target = 12.0
  c.align.lora_rank, c.align.lora_alpha = 16, 32.0
  o.lr, o.warmup_steps = 5e-5, 3
  if rm:
    common.hh_pairs(c)
    p.reward = "rm:" + RM_SMOLLM2
  else:
    common.arith_prompts(c)
    p.reward = common.ARITH_REWARD
    p.temperature = 0.7  # as grpo.py:smollm2: at 1 a 135M model's sums are mostly noise
  return c
