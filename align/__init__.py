"""Alignment training (SFT, reward models, DPO, PPO/GRPO) on the shared train/infer loops.

Nothing here yet: the alignment issue fills this package in.
"""
