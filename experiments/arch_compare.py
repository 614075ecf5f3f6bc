"""Decoder-only vs encoder-decoder vs prefix-LM (hybrid) on one seq2seq task, equal sizes.

The task is train/seq2seq_data.py's default: reverse the words of a 3-6 word line of Tiny
Shakespeare. All three use the same tokenizer, blocks (RMSNorm, SwiGLU, RoPE, d_model 128),
optimizer, steps and examples; only the wiring differs. Parameter counts (models.param_count):
decoder and prefix_lm 4 layers x mlp_dim 352; encoder_decoder 2 encoder + 2 decoder layers
x mlp_dim 288, whose smaller MLPs pay for the decoder's cross-attention (benchmarks/arch_compare.py
reports each as `params`). The decoder-only rows hold source and target,
so they are twice as long (seq_len 128) as the encoder-decoder's (source_len = seq_len = 64).
Embeddings are untied: tied, the encoder-decoder scales its output by d_model**-0.5 as T5
does, which with this init_std (0.02) left it far behind (benchmarks/arch_compare.py --tied).

  meshlm train --config experiments/arch_compare.py:decoder --workdir runs/arch_decoder
  meshlm train --config experiments/arch_compare.py:prefix_lm --workdir runs/arch_prefix_lm
  meshlm train --config experiments/arch_compare.py:encoder_decoder --workdir runs/arch_enc_dec
  python -m benchmarks.arch_compare      # all three, held-out loss and exact match as JSON

Without `:ARCH`, `meshlm train --config experiments/arch_compare.py` trains the decoder.
"""

from train.data_root import data_path
from train.defaults import base_config

ARCHS = ("decoder", "prefix_lm", "encoder_decoder")


def get_config(arch: str = "decoder"):
  if arch not in ARCHS:
    raise ValueError(f"arch={arch!r}; choose one of {ARCHS}")
  c = base_config()
  c.steps = 400
  c.batch_size = 16
  c.seq_len = 128
  c.log_every = 25
  c.eval_every = 50
  c.eval_batches = 1000     # the whole validation split (it ends first)
  c.checkpoint_every = 400

  c.model.arch = arch
  c.model.vocab_size = 1024
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.mlp_dim = 352
  c.model.max_seq_len = 128
  c.model.tie_embeddings = False
  if arch == "encoder_decoder":
    c.model.num_layers = 2          # encoder
    c.model.num_decoder_layers = 2
    c.model.mlp_dim = 288
    c.seq_len = 64

  c.tokenizer.train_vocab_size = 1024
  c.data.path = data_path("tinyshakespeare", "input.txt")
  c.data.task = "seq2seq"
  c.data.val_fraction = 0.1
  c.data.seq2seq.transform = "reverse_words"
  c.data.seq2seq.min_words = 3
  c.data.seq2seq.max_words = 6
  c.data.seq2seq.source_len = 64

  c.optimizer.lr = 3e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.0
  c.sample.max_new_tokens = 0
  return c

