"""align/ losses against TRL's own code (tests/workers/align_trl_cases.py), run in a
process of its own so trl, datasets and pyarrow stay out of the main test process."""

import subprocess
import sys

import deps
from conftest import REPO


def test_losses_match_trl_in_their_own_process():
  for module in ("trl", "torch", "transformers", "accelerate"):
    deps.installed(module)
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/workers/align_trl_cases.py"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  assert "4 passed" in run.stdout, run.stdout[-2000:]
