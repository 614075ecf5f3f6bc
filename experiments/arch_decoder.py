"""The decoder of experiments/arch_compare.py (see there).

  meshlm train --config experiments/arch_decoder.py --workdir runs/arch_decoder
"""

from experiments import arch_compare


def get_config():
  return arch_compare.get_config("decoder")
