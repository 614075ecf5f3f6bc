"""GRPO as in DeepSeekMath (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
Reasoning in Open Language Models", Section 4.1 and the setup of Section 4.2): no critic; each
question is answered G = 64 times and each answer's advantage is its reward normalised within
its group, (r - mean) / std; the loss is the clipped surrogate averaged over each answer's
tokens, then over answers (Equation 3), plus β·KL(π‖π_ref) by the k3 estimator (Equation 4)
with β = 0.04; policy lr 1e-6; training batch 1024 answers (16 questions x 64); one policy
update per exploration stage (epochs = minibatches = 1); max length 1024 (read here as the
answer's). The policy is DeepSeekMath-Instruct 7B (DeepSeek-LLM 7B's shape). The paper gives
no clip ratio (0.2 here, as PPO and TRL), temperature (1), schedule (constant) or step count
(9,000 here: one pass over its 144K GSM8K and MATH questions at 16 a step).

Not reproduced: the paper's outcome reward is a trained reward model over GSM8K/MATH
chain-of-thought answers; here it is the programmatic `arith` reward (align/arith.py) on the
arithmetic word problems of data/arith, at both scales.

Paper scale, 64 devices (FSDP), the 1024 rows of a step in 4 microbatches:

  meshlm plan --config experiments/repro/grpo.py --devices 64 --budget_gb 80 --compile
  meshlm grpo --config experiments/repro/grpo.py --workdir runs/repro/grpo \\
      --config.init_from=INSTRUCT_WORKDIR

:smollm2, SmolLM2-135M-Instruct with LoRA adapters (the reference is the base), on one CPU in
under an hour (docs/alignment.md has the measured step time):

  meshlm grpo --config experiments/repro/grpo.py:smollm2 --workdir runs/repro/grpo_smollm2
"""

from experiments.repro import common


def get_config(variant: str = "paper"):
  c = common.base("grpo", variant)
  common.arith_prompts(c)
  g = c.align.grpo
  g.reward, g.prompts, g.temperature = common.ARITH_REWARD, "chat", 1.0
  g.beta, g.clip, g.clip_high, g.loss_type = 0.04, 0.2, 0.0, "grpo"
  g.epochs, g.minibatches = 1, 1
  o = c.optimizer
  o.lr, o.warmup_steps, o.min_lr_ratio = 1e-6, 0, 1.0
  o.b1, o.b2, o.weight_decay = 0.9, 0.95, 0.0
  if variant == "paper":
    m = c.model  # DeepSeek-LLM 7B (DeepSeek-AI 2024, Table 2): Llama-style, 30 layers
    m.vocab_size, m.d_model, m.num_layers = 102400, 4096, 30
    m.num_heads = m.num_kv_heads = 32
    m.mlp_dim, m.max_seq_len, m.rope_theta, m.norm_eps = 11008, 4096, 10000.0, 1e-6
    common.pod(c)
    c.steps, c.batch_size, c.seq_len, c.grad_accum = 9000, 1024, 1536, 4
    g.group_size, g.max_new_tokens = 64, 1024
    c.eval_batches = 4
    return c
  # One CPU: LoRA, 2 questions x G = 8 answers a step, 64 new tokens, sampled at 0.7: at 1.0
  # the 135M model's samples are so often wrong that most groups score all 0 (no signal).
  common.smollm2(c, steps=64)  # ~44 s a step on 2 cores: under the hour with its evaluation
  c.batch_size, c.seq_len = 16, 160
  c.eval_batches = 16           # 32 held-out questions (2 a batch), one answer each
  g.group_size, g.max_new_tokens, g.temperature = 8, 64, 0.7
  c.align.lora_rank, c.align.lora_alpha = 16, 32.0
  o.lr, o.warmup_steps = 1e-4, 3  # adapters from zero need more than the paper's 1e-6
  return c
