"""Alignment on the shared train and infer loops: the objectives (SFT, reward models, DPO,
PPO/GRPO, distillation: align/tasks.py's AlignTask subclasses, stepped by
train/step.py's objective_step), their data (align/data.py, align/datasets.py) and LoRA
(align/lora.py); teacher-judged preference data with human review (align/curate/); and
helpful/harmless/honest evaluation and red teaming (align/evals/).
"""
