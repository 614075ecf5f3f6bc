"""Reproduction configs: one per alignment method (rm, dpo, ppo, grpo) at its paper's scale,
each with a `:smollm2` variant that runs the same code on SmolLM2-135M-Instruct on one CPU
(docs/alignment.md, "Reproduction configs")."""
