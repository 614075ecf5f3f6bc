"""The full set of config keys, with defaults; every experiment starts from `base_config()`.

Configs are locked after `get_config()`, so a misspelt key in a file or on the
command line (`--config.optimizer.lrr=1`) fails instead of being ignored.
"""

from ml_collections import ConfigDict

from models import ModelConfig

# LoRA's default targets: attention and dense MLP projections, and latent attention's
# (models/mla.py) where a model has it (align/lora.py).
LORA_TARGETS = ("wq_DNH,wk_DKH,wv_DKH,wo_NHD,gate_DF,up_DF,down_FD,"
                "wq_DNX,wq_a_DQ,wq_b_QNX,wkv_a_DC,wkr_DR,wk_b_CNH,wv_b_CNU,wo_NUD")


def base_config() -> ConfigDict:
  c = ConfigDict()
  c.seed = 0
  c.steps = 1000
  c.stop_at_step = 0        # >0: end this invocation after checkpointing this step (time-boxed jobs)
  c.batch_size = 8          # global, in sequences
  c.seq_len = 256
  c.grad_accum = 1          # microbatches per step; batch_size must divide evenly
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 4
  c.eval_at_start = False   # also evaluate the starting model (step 0), a baseline
  c.checkpoint_every = 200
  c.keep_checkpoints = 3
  c.keep_checkpoint_every = 0   # >0: also keep every checkpoint whose step is a multiple of this
  c.async_checkpoints = True
  c.checkpoint_compression = False  # zstd: ~10% fewer bytes, more CPU per save
  c.checkpoint_idle_writer = False  # Linux: background writes at SCHED_IDLE (docs/fault_tolerance.md)
  c.peak_flops_per_device = 0.0   # 0: data-sheet value on accelerators, measured on CPU
  c.init_from = ""          # optional: HF directory, .gguf file, or meshlm workdir to start from

  c.model = ConfigDict(ModelConfig().to_dict())
  # Placeholders so that the types are fixed; None would accept any type.
  c.model.head_dim = 0      # 0: d_model // num_heads
  c.model.bos_id = -1
  c.model.eos_id = -1

  c.tokenizer = ConfigDict()
  c.tokenizer.path = ""      # tokenizer.json directory, HF directory or .gguf
  c.tokenizer.train_vocab_size = 0  # >0: train a byte-level BPE on the training text

  c.data = ConfigDict()
  c.data.path = ""
  c.data.text_key = "text"
  c.data.doc_separator = "\n\n"
  c.data.val_fraction = 0.05
  c.data.num_shards = 0      # 0: one shard per process; fix it to compare process counts
  c.data.task = "lm"         # "lm": packed documents | "seq2seq": train/seq2seq_data.py pairs
                             # | "mlm": masked packed documents for encoders (train/mlm_data.py)
  c.data.validation_path = ""  # alignment runs: held-out files (else a hash split by prompt)
  # Training data sharing n-grams with protected evaluation sets (data/protected_evals.json)
  # is refused (train/decontam.py): more than max_overlap_rows (a fraction) of rows overlap
  # and allow is False. eval_sets: "default" (all registered) | "name,asset_dir,..." | "" (off).
  c.data.decontam = ConfigDict(dict(n=13, min_tokens=8, max_overlap_rows=0.0, allow=False,
                                    eval_sets="default"))
  c.data.mlm = ConfigDict(dict(mask_prob=0.15))  # BERT: 15% chosen; 80% [MASK], 10% random
  # data.task="seq2seq": how (source, target) pairs are made (train/seq2seq_data.py).
  c.data.seq2seq = ConfigDict(dict(
      transform="reverse_words",  # from the text's lines: reverse_words | sort_words | "" (.jsonl)
      min_words=3, max_words=6,   # lines of this many words become sources
      source_key="source", target_key="target",  # transform "": the .jsonl fields
      source_len=32))             # encoder length S; a longer source is an error

  # Alignment (`meshlm sft|rm|dpo|distill`, align/): data.path holds JSONL records
  # (align/data.py), rows are seq_len tokens, batch_size counts sequences or pairs.
  c.align = ConfigDict()
  c.align.lora_rank = 0          # >0: train LoRA adapters on a frozen base (align/lora.py)
  c.align.lora_alpha = 16.0
  c.align.lora_targets = LORA_TARGETS
  c.align.drop_turns = True      # pairs too long for seq_len drop their oldest turns first
  c.align.max_skipped_fraction = 0.5  # refuse data of which more than this is bad
  c.align.rm = ConfigDict(dict(head_std=0.02, center_coef=0.0))
  c.align.dpo = ConfigDict(dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                                reference_free=False, reference="online"))  # | "cached"
  c.align.distill = ConfigDict(dict(teacher="", temperature=2.0, alpha=0.5,
                                    response_only=False))
  # On-policy RL (`meshlm ppo|grpo`, align/ppo.py, align/grpo.py): batch_size counts sampled
  # completions; rows hold prompt + completion in seq_len tokens. reward: align/rewards.py
  # ("letter:e", "word:W", "length:LO:HI", "arith", "rm:WORKDIR"); prompts: "chat" | "text".
  c.align.ppo = ConfigDict(dict(
      reward="letter:e", prompts="chat", max_new_tokens=32, temperature=0.7,
      kl_coef=0.05, kl_estimator="k1",   # | "k3"
      kl_target=0.0, kl_horizon=10000.0,  # kl_target > 0: adaptive kl_coef (Ziegler et al.)
      gamma=1.0, lam=0.95, whiten_advantages=True, clip=0.2, value_clip=0.2, vf_coef=0.1,
      entropy_coef=0.0, epochs=4, minibatches=1))  # epochs x minibatches updates a step
  c.align.grpo = ConfigDict(dict(
      reward="letter:e", prompts="chat", max_new_tokens=32, temperature=1.0,
      group_size=4,                       # completions per prompt (batch_size // G prompts)
      beta=0.04,                          # k3 KL to the reference; 0: no reference
      clip=0.2, clip_high=0.0,            # clip_high 0: = clip
      loss_type="grpo",                   # | "bnpo" | "dr_grpo"
      epochs=1, minibatches=1))

  c.optimizer = ConfigDict()
  c.optimizer.lr = 3e-4
  c.optimizer.warmup_steps = 100
  c.optimizer.min_lr_ratio = 0.1
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1
  c.optimizer.clip_norm = 1.0

  c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, pipeline=1, expert=1, sequence=1))
  c.sharding = "data_parallel"   # strategies joined with '+', e.g. "fsdp+tensor"

  c.pipeline = ConfigDict()
  c.pipeline.microbatches = 0     # 0: one per stage (stages = mesh.pipeline)
  c.pipeline.repeats = 1          # virtual stages per stage; > 1 needs schedule "circular"
  c.pipeline.schedule = "gpipe"   # "gpipe" | "circular"

  # What to do about a non-finite or spiking loss: "skip" leaves the state
  # untouched for non-finite steps (spikes are only logged); "rollback" restores
  # the last checkpoint and skips the data window since then.
  c.anomaly = ConfigDict(dict(policy="skip", zscore=0.0, window=50, max_rollbacks=5))
  # Hang watchdog: exit 76 when a step outlasts max(min_seconds, factor x median step time).
  c.watchdog = ConfigDict(dict(factor=20.0, min_seconds=600.0))
  # Multi-process: exit 77 when a peer has been silent this long (keep well under
  # parallel.distributed.HEARTBEAT_TIMEOUT_S / 2, where JAX aborts on its own).
  c.peer_timeout_seconds = 20.0
  # Evaluation gate (align/evals/promote.py): every N steps run `meshlm eval`'s suite on the
  # current model and promote the checkpoint (WORKDIR/promoted.json) only if it passes the
  # gate against `baseline` (empty: the starting model's report). every=0: off.
  c.eval_gate = ConfigDict(dict(every=0, suite="hhh", limit=20, baseline="", max_drop="",
                                judge="", seed=0, max_new_tokens=64))
  # Test hooks: poison the gradients / sleep at this (1-based) step; -1 is off.
  c.debug = ConfigDict(dict(nan_at_step=-1, slow_step_at=-1, slow_step_seconds=0.0))

  c.sample = ConfigDict()
  c.sample.prompt = ""
  c.sample.max_new_tokens = 128
  c.sample.temperature = 0.8
  c.sample.top_k = 0
  return c


def model_config_from(c: ConfigDict) -> ModelConfig:
  """ModelConfig from `config.model`, mapping the typed placeholders back to None."""
  values = c.model.to_dict()
  for key, unset in (("head_dim", 0), ("bos_id", -1), ("eos_id", -1)):
    if values.get(key) == unset:
      values[key] = None
  return ModelConfig.from_mapping(values)
