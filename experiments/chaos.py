"""The chaos soak's training run: the quickstart model made small and fast, plus the soak's
own settings (`chaos.*`).

  python -m benchmarks.chaos --workdir runs/chaos [--config.chaos.mtbf_seconds=20]
  meshlm train --config experiments/chaos.py --workdir runs/chaos_once   (no failures)

benchmarks/chaos.py kills and restarts these runs; see its docstring for what it measures.
"""

from ml_collections import ConfigDict

from experiments.quickstart import get_config as quickstart_config


def get_config():
  c = quickstart_config()
  c.steps = 600             # ~1 min of steps: a few MTBFs, so that failures do strike
  c.batch_size = 4          # 0.06-0.1 s steps on a 2-core CPU
  c.log_every = 1           # goodput.json and metrics.jsonl are written at every log
  c.eval_every = 1_000_000  # one evaluation, at the last step
  c.eval_batches = 1
  c.keep_checkpoints = 2
  c.model.vocab_size = 512
  c.tokenizer.train_vocab_size = 512
  c.peak_flops_per_device = 1e11  # skips measuring the CPU's peak at every start
  c.sample.max_new_tokens = 0
  c.chaos = ConfigDict(dict(
      mtbf_seconds=20.0, checkpoint_intervals=(5, 20, 80), seed=0,
      max_restarts=100,        # per interval: the scheduler gives up after this many
      max_wall_seconds=1800.0,  # per interval
      max_kills=-1,            # stop killing after this many (-1: never); for tests
      restart_delay_seconds=0.0,  # a scheduler's delay before each restart, counted as wall
      compilation_cache=True))
  return c
