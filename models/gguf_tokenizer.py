"""The tokenizer embedded in a llama.cpp GGUF file, as a `tokenizers.Tokenizer` that encodes
as llama.cpp does.

Byte-level BPE vocabularies ("gpt2") carry their merges and a pre-tokenizer name
(`tokenizer.ggml.pre`) that picks the split pattern. SentencePiece vocabularies ("llama")
carry pieces and scores: llama.cpp merges the adjacent pair whose joined piece scores highest,
again and again, and spells what no piece covers as <0xXX> byte tokens. A BPE model whose
merges are every split of a piece into two pieces, ranked by the joined piece's score, with
byte fallback, does the same; the text is prefixed with a space (add_space_prefix, after each
special token too) and its spaces written "▁" first.
"""

import warnings

import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from models.tokenizer import Tokenizer

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp defines them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}
_GPT2_PRES = ("gpt2", "default", "gpt-2")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # token types
_SPACE = "\u2581"  # SentencePiece's visible space


def field(reader: GGUFReader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


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
  """The `tokenizers.Tokenizer` of the vocabulary embedded in the file: byte-level BPE
  ("gpt2": SmolLM, Llama 3, Qwen) or SentencePiece ("llama": Llama 2, Mistral, Gemma, and what
  llama.cpp's converter writes from a tokenizer.model)."""
  kind = field(reader, "tokenizer.ggml.model")
  if kind not in ("gpt2", "llama"):
    raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level "
                     "BPE ('gpt2', as in SmolLM, Llama 3, Qwen) and SentencePiece ('llama', as "
                     "in Llama 2, Mistral, Gemma)")
  tokens = field(reader, "tokenizer.ggml.tokens")
  if not tokens:
    raise ValueError(f"{path}: no embedded vocabulary (tokenizer.ggml.tokens)")
  types = field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  if kind == "llama":
    return _spm(reader, path, tokens, types)
  alphabet = set(pre_tokenizers.ByteLevel.alphabet())
  to_bytes_chars = {b: c for b, c in enumerate(_byte_chars())}

  def spell(token):
    # Vocab entries are byte-level strings; one written in plain UTF-8 is re-spelled.
    if set(token) <= alphabet:
      return token
    return "".join(to_bytes_chars[b] for b in token.encode("utf-8"))

  vocab = {spell(t): i for i, t in enumerate(tokens)}
  merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
  tok.decoder = decoders.ByteLevel()
  bos_id = field(reader, "tokenizer.ggml.bos_token_id")
  add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
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
  return Tokenizer(tok, bos_id=bos_id, eos_id=field(reader, "tokenizer.ggml.eos_token_id"),
                   pad_id=field(reader, "tokenizer.ggml.padding_token_id"),
                   chat_template=field(reader, "tokenizer.chat_template"), add_bos=add_bos)


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


def _spm(reader: GGUFReader, path: str, tokens: list, types: list) -> Tokenizer:
  """SentencePiece pieces and scores as a byte-fallback BPE (module docstring)."""
  scores = field(reader, "tokenizer.ggml.scores")
  if not scores or len(scores) != len(tokens):
    raise ValueError(f"{path}: a SentencePiece vocabulary needs one score per token "
                     f"(tokenizer.ggml.scores has {len(scores or [])}, tokens {len(tokens)})")
  vocab = {t: i for i, t in enumerate(tokens)}
  unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
  mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
  ranked = []  # (-score of the joined piece, its id, left piece's length, left, right)
  for piece, i in mergeable.items():
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in vocab and right in vocab:
        ranked.append((-scores[i], i, cut, left, right))
  merges = [(left, right) for *_, left, right in sorted(ranked)]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                                                   fuse_unk=True, byte_fallback=True))
  prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
  steps = [normalizers.Prepend(_SPACE)] if prefix else []
  tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
  tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                   decoders.Fuse(), *([decoders.Strip(" ", 1, 0)] if prefix
                                                      else [])])
  bos_id = field(reader, "tokenizer.ggml.bos_token_id")
  add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", True))  # llama.cpp's default
  if add_bos and bos_id is not None:
    bos = tokens[bos_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
  return Tokenizer(tok, bos_id=bos_id, eos_id=field(reader, "tokenizer.ggml.eos_token_id"),
                   pad_id=field(reader, "tokenizer.ggml.padding_token_id"),
                   chat_template=field(reader, "tokenizer.chat_template"), add_bos=add_bos)
