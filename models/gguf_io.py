"""llama.cpp GGUF files: config from `llama.*` metadata, dequantized tensors, and the tokenizer.

Tensors are served under Hugging Face names so models/hf_io.py does the layout
conversion for both formats. llama.cpp's converter permutes the rows of the Q and K
projections into the interleaved (GPT-J) RoPE layout; we undo that here so our
half-split ("rotate_half") RoPE sees the original Hugging Face weights.
"""

import os
import re
import warnings

import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from models.config import ModelConfig
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
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp defines them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}
_GPT2_PRES = ("gpt2", "default", "gpt-2")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _hf_name(gguf_name: str) -> str:
  """Hugging Face name of a GGUF tensor; unknown names pass through (and are then rejected)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
  if m and m.group(2) in _LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
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


def _field(reader: GGUFReader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


class GGUFTensors:
  """Dequantized float32 tensors of a GGUF file, read lazily under Hugging Face names."""

  def __init__(self, reader: GGUFReader, cfg: ModelConfig):
    self.cfg = cfg
    self.tensors = {_hf_name(t.name): t for t in reader.tensors}

  @property
  def names(self) -> list[str]:
    return list(self.tensors)

  def rope_heads(self, name: str) -> int | None:
    """Heads whose rows llama.cpp permuted for RoPE (Q and K projections), else None."""
    if name.endswith("q_proj.weight"):
      return self.cfg.num_heads
    if name.endswith("k_proj.weight"):
      return self.cfg.num_kv_heads
    return None

  def read(self, name: str) -> np.ndarray:
    t = self.tensors[name]
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    heads = self.rope_heads(name)
    return w if heads is None else unpermute_rope(w, heads)


def check_tensor_types(reader: GGUFReader, path: str) -> None:
  for t in reader.tensors:
    if t.tensor_type not in SUPPORTED_TYPES:
      raise ValueError(
          f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported; "
          f"supported types: {', '.join(q.name for q in SUPPORTED_TYPES)}")


def config_from_gguf(reader: GGUFReader, path: str, **overrides) -> ModelConfig:
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; only 'llama' is supported")
  get = lambda key, default=None: _field(reader, f"llama.{key}", default)
  if get("expert_count", 0):
    raise ValueError(f"{path}: mixture-of-experts llama (expert_count={get('expert_count')}) "
                     "is not supported")
  names = {t.name for t in reader.tensors}
  scaling = get("rope.scaling.type", "none")
  if scaling not in ("none", None) and not (scaling == "linear"
                                            and get("rope.scaling.factor", 1.0) == 1.0):
    raise ValueError(f"{path}: rope scaling {scaling!r} is not supported; only plain RoPE")
  if "rope_freqs.weight" in names:
    raise ValueError(f"{path}: rope_freqs.weight (llama3-style rope scaling) is not supported")
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
  values = dict(
      vocab_size=vocab, d_model=d, num_layers=get("block_count"), num_heads=heads,
      num_kv_heads=get("attention.head_count_kv") or heads, head_dim=head_dim,
      mlp_dim=get("feed_forward_length"), rope_theta=float(get("rope.freq_base", 10000.0)),
      norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in names,  # llama.cpp omits output.weight when tied
      max_seq_len=get("context_length", 2048),
      bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_id=_field(reader, "tokenizer.ggml.eos_token_id"))
  values.update({k: v for k, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def _pre_tokenizer(pre: str | None):
  if pre == "smollm":
    # SmolLM's own tokenizer.json: every digit alone, then GPT-2 byte-level splitting.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
  if pre in _SPLITS:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre not in _GPT2_PRES and pre is not None:
    warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known here; using GPT-2 splitting, "
                  "which may tokenize some text differently from llama.cpp")
  return pre_tokenizers.ByteLevel(add_prefix_space=False)


def tokenizer_from_gguf(reader: GGUFReader, path: str) -> Tokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` from the vocabulary embedded in the file."""
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level "
                     "BPE ('gpt2', as in SmolLM, Llama 3, Qwen) is")
  tokens = _field(reader, "tokenizer.ggml.tokens")
  if not tokens:
    raise ValueError(f"{path}: no embedded vocabulary (tokenizer.ggml.tokens)")
  types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  alphabet = set(pre_tokenizers.ByteLevel.alphabet())
  to_bytes_chars = {b: c for b, c in enumerate(_byte_chars())}

  def spell(token):
    # Vocab entries are byte-level strings; one written in plain UTF-8 is re-spelled.
    if set(token) <= alphabet:
      return token
    return "".join(to_bytes_chars[b] for b in token.encode("utf-8"))

  vocab = {spell(t): i for i, t in enumerate(tokens)}
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
  tok.decoder = decoders.ByteLevel()
  bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
  add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
  if add_bos and bos_id is not None:
    bos = tokens[bos_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  # Control tokens (<|im_start|>) and user-defined ones must match whole, never be split.
  # A "control" token outside the byte alphabet is a llama.cpp mislabel; adding it
  # would grow the vocabulary, so it is skipped (as transformers does).
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
  return Tokenizer(tok, bos_id=bos_id, eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                   pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
                   chat_template=_field(reader, "tokenizer.chat_template"), add_bos=add_bos)


def _byte_chars() -> list[str]:
  """GPT-2's byte -> printable character table (bytes_to_unicode), indexed by byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


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
  """(config, lazily dequantized tensors under HF names, tokenizer) of a llama GGUF file."""
  reader = open_gguf(path)
  check_tensor_types(reader, path)  # fail before any slow work
  cfg = config_from_gguf(reader, path, **overrides)
  return cfg, GGUFTensors(reader, cfg), tokenizer_from_gguf(reader, path)
