"""llama.cpp GGUF files: the config from an architecture's metadata, dequantized tensors under
Hugging Face names, and the tokenizer (models/gguf_tokenizer.py).

A file's architecture (`general.architecture`: llama, qwen2, gemma2) maps to a Hugging Face
family (models/families/): its metadata become that family's config.json keys and its
tensors that family's names, so the family's mapping and models/hf_io.py's layout conversion
serve both formats. What llama.cpp's converter changed is undone here: it permutes the rows
of Llama's Q and K projections into interleaved (GPT-J) RoPE pairs, which we put back into
halves for our half-split ("rotate_half") RoPE, and it stores Gemma's norm scales as 1 + w.
Llama 3.1's RoPE scaling arrives as per-frequency divisors (rope_freqs.weight), which the
model applies as given (rope scheme "factors").
"""

import os
import re

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from models.config import ModelConfig
from models.families import config_from_hf
from models.gguf_tokenizer import field, tokenizer_from_gguf
from models.tokenizer import Tokenizer

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q8_0)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma 2's four norms a layer: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA2_NAMES = {**_LAYER_NAMES, "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# GGUF architecture -> (Hugging Face architecture, model_type, per-layer names)
ARCHS = {"llama": ("LlamaForCausalLM", "llama", _LAYER_NAMES),
         "qwen2": ("Qwen2ForCausalLM", "qwen2", _LAYER_NAMES),
         "gemma2": ("Gemma2ForCausalLM", "gemma2", _GEMMA2_NAMES)}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency divisors: config, not a weight


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
  """Hugging Face name of a GGUF tensor; unknown names pass through (and are then rejected)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  layer_names = ARCHS[arch][2]
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
  if m and m.group(2) in layer_names:
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
  return gguf_name


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's `permute` (convert_hf_to_gguf.py): half-split rows to interleaved pairs."""
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of `permute_rope`: interleaved rotary pairs back to half-split rows."""
  # llama.cpp viewed each head's rows as [2, H/2] and stored them as [H/2, 2].
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
  """Dequantized float32 tensors of a GGUF file, read lazily under Hugging Face names."""

  def __init__(self, reader: GGUFReader, cfg: ModelConfig, arch: str = "llama"):
    self.cfg, self.arch = cfg, arch
    self.tensors = {_hf_name(t.name, arch): t for t in reader.tensors if t.name != ROPE_FREQS}

  @property
  def names(self) -> list[str]:
    return list(self.tensors)

  def rope_heads(self, name: str) -> int | None:
    """Heads whose rows llama.cpp permuted for RoPE (Llama's Q and K projections), else None."""
    if self.arch != "llama":  # llama.cpp runs Qwen2 and Gemma 2 with half-split RoPE
      return None
    if name.endswith("q_proj.weight"):
      return self.cfg.num_heads
    if name.endswith("k_proj.weight"):
      return self.cfg.num_kv_heads
    return None

  def read(self, name: str) -> np.ndarray:
    t = self.tensors[name]
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    if self.arch == "gemma2" and name.endswith("norm.weight"):
      return w - 1.0  # llama.cpp's converter stored Gemma's 1 + w
    heads = self.rope_heads(name)
    return w if heads is None else unpermute_rope(w, heads)


def check_tensor_types(reader: GGUFReader, path: str) -> None:
  for t in reader.tensors:
    if t.tensor_type not in SUPPORTED_TYPES:
      raise ValueError(
          f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported; "
          f"supported types: {', '.join(q.name for q in SUPPORTED_TYPES)}")


def config_from_gguf(reader: GGUFReader, path: str, **overrides) -> ModelConfig:
  """The ModelConfig of a GGUF file: its metadata as its family's config.json keys, read by
  that family (models/families/), which refuses by name what it cannot run."""
  arch = field(reader, "general.architecture")
  if arch not in ARCHS:
    raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; only {sorted(ARCHS)}")
  get = lambda key, default=None: field(reader, f"{arch}.{key}", default)  # noqa: E731
  if get("expert_count", 0):
    raise ValueError(f"{path}: mixture-of-experts {arch} (expert_count={get('expert_count')}) "
                     "is not supported")
  names = {t.name for t in reader.tensors}
  d, heads = get("embedding_length"), get("attention.head_count")
  if not isinstance(heads, int):
    raise ValueError(f"{path}: per-layer head counts ({heads!r}) are not supported")
  head_dim = get("attention.key_length") or d // heads
  if get("rope.dimension_count", head_dim) != head_dim:
    raise ValueError(f"{path}: partial rotary (rope.dimension_count="
                     f"{get('rope.dimension_count')} < head_dim={head_dim}) is not supported")
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  vocab = (len(tokens.data) if tokens is not None else get("vocab_size")
           or (int(embed.shape[1]) if embed is not None else None))
  architecture, model_type, _ = ARCHS[arch]
  hf = {"architectures": [architecture], "model_type": model_type, "vocab_size": vocab,
        "hidden_size": d, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads, "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 2048),
        # llama.cpp omits output.weight when the embeddings are tied
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id")}
  hf.update(_ARCH_KEYS[arch](get, names, path, hf))
  return config_from_hf(hf, source=path, **_rope_overrides(reader, get, names, path),
                        **overrides)


def _llama_keys(get, names, path, hf) -> dict:
  scaling = get("rope.scaling.type", "none")
  if scaling in ("none", None):
    return {}
  if scaling == "linear":
    return {"rope_scaling": {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}}
  raise ValueError(f"{path}: rope scaling {scaling!r} is not supported; only linear, and "
                   "Llama 3's rope_freqs")


def _qwen2_keys(get, names, path, hf) -> dict:
  if "blk.0.attn_q.bias" not in names:
    raise ValueError(f"{path}: a qwen2 file without q/k/v biases (blk.0.attn_q.bias)")
  return {"use_sliding_window": False, **_llama_keys(get, names, path, hf)}


def _gemma2_keys(get, names, path, hf) -> dict:
  # llama.cpp scales Gemma 2's queries by head_dim ** -0.5, but the 27B's (46 layers) by
  # (hidden / heads) ** -0.5: the file does not say query_pre_attn_scalar, llama.cpp assumes it.
  scalar = (hf["hidden_size"] // hf["num_attention_heads"] if hf["num_hidden_layers"] == 46
            else hf["head_dim"])
  # llama.cpp's defaults where an older conversion left a key out (llama-hparams, gemma2)
  window = get("attention.sliding_window", 4096) or 0
  return {"query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
          "attn_logit_softcapping": get("attn_logit_softcapping", 50.0),
          "final_logit_softcapping": get("final_logit_softcapping", 30.0),
          "sliding_window": window or None, "tie_word_embeddings": True,
          "layer_types": [("sliding_attention" if window and i % 2 == 0 else "full_attention")
                          for i in range(hf["num_hidden_layers"])]}


_ARCH_KEYS = {"llama": _llama_keys, "qwen2": _qwen2_keys, "gemma2": _gemma2_keys}


def _rope_overrides(reader: GGUFReader, get, names, path) -> dict:
  """Llama 3.1's RoPE scaling as llama.cpp applies it: each frequency divided by its entry of
  rope_freqs.weight (the converter computed them from the llama3 parameters)."""
  if ROPE_FREQS not in names:
    return {}
  t = next(t for t in reader.tensors if t.name == ROPE_FREQS)
  factors = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
  return {"rope_scaling": "factors", "rope_freq_factors": tuple(float(f) for f in factors)}


class FastGGUFReader(GGUFReader):
  """gguf's reader, slicing a plain ndarray view of the mapped file: every np.memmap slice
  pays memmap's bookkeeping, and a tokenizer's 100k strings are 200k slices (~10 s to open
  SmolLM2). Same bytes, same views, same parse."""

  def _get(self, offset, dtype, count=1, override_order=None):
    if getattr(self, "_raw", None) is None or self._raw.base is not self.data:
      self._raw = self.data.view(np.ndarray)
    dtype = np.dtype(dtype)
    count = int(count)
    arr = self._raw[offset:offset + dtype.itemsize * count].view(dtype)[:count]
    return arr.view(arr.dtype.newbyteorder(override_order or self.byte_order))


def open_gguf(path: str) -> GGUFReader:
  """The file's reader; ValueError saying the file is truncated or damaged where its header
  does not parse or a tensor's bytes run past its end (the reader's own errors name neither
  the file nor the cause: "cannot reshape array of size ...")."""
  size = os.path.getsize(path)
  try:
    reader = FastGGUFReader(path)
  except Exception as e:  # gguf's parser: struct, reshape and index errors
    raise ValueError(f"{path} is not a readable GGUF file: truncated or damaged "
                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), "
                     f"{size:,} bytes") from None
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise ValueError(f"{path} is truncated: tensor {t.name} ends at byte {end:,}, the file "
                       f"has {size:,}")
  return reader


def read_gguf(path: str, **overrides) -> tuple[ModelConfig, GGUFTensors, Tokenizer]:
  """(config, lazily dequantized tensors under HF names, tokenizer) of a GGUF file."""
  reader = open_gguf(path)
  check_tensor_types(reader, path)  # fail before any slow work
  cfg = config_from_gguf(reader, path, **overrides)
  arch = field(reader, "general.architecture")
  return cfg, GGUFTensors(reader, cfg, arch), tokenizer_from_gguf(reader, path)
