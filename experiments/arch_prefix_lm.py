"""The prefix_lm of experiments/arch_compare.py (see there).

  meshlm train --config experiments/arch_prefix_lm.py --workdir runs/arch_prefix_lm
"""

from experiments import arch_compare


def get_config():
  return arch_compare.get_config("prefix_lm")
