"""Seq2seq examples from real text, batched alike for decoder, prefix-LM and encoder-decoder.

The task (`data.seq2seq.transform`):
  reverse_words  target = the source line's words in reverse order (the default)
  sort_words     target = the source line's words sorted case-insensitively
  ""             (source, target) pairs read from .jsonl keys data.seq2seq.source_key/target_key
Sources are the distinct lines of the `data.path` documents with min_words..max_words words
(lines ending in ':' are speaker headings and are skipped). Word reversal is the default
because the first target word is the source's last, so no model can start before it has
read the whole source; a wrong word anywhere fails the example, so exact match means
something; and it is learnable on a CPU in minutes, unlike translation-style tasks.

The split hashes the source line (train/data.py is_validation): deterministic, disjoint,
independent of file order. Each example is one segment (segment ids 1, 2, ... within a row,
positions restarting at 0), packed first-fit several to a row; 0 pads every field:
  decoder, prefix_lm  [B, T]: seq = source + [sep] + target + [eos];
                      inputs = seq[:-1], targets = seq[1:]; loss_mask 1 on the targets
                      that are target or eos tokens; prefix 1 on source + sep (prefix_lm).
  encoder_decoder     enc_inputs, enc_segment_ids, enc_positions [B, S] = source;
                      inputs [B, T] = [sep] + target, targets = target + [eos], loss_mask 1;
                      an example has the same segment id on both sides.
sep is the tokenizer's BOS: it never occurs inside text, and it is the token after which
every architecture starts generating. T = config.seq_len, S = data.seq2seq.source_len; an
example that does not fit raises, naming it, rather than being dropped.
"""

import functools
from typing import Any, Mapping

import grain
import jax
import numpy as np

from models.tokenizer import Tokenizer
from train import data as data_lib

TASKS = ("lm", "seq2seq")
TRANSFORMS = {
    "reverse_words": lambda words: words[::-1],
    "sort_words": lambda words: sorted(words, key=str.lower),
}
DECODER_ARCHS = ("decoder", "prefix_lm")
ARCHS = DECODER_ARCHS + ("encoder_decoder",)


# --- Examples: (source, target) text pairs and their token ids ---


def _lines(data_cfg: Mapping[str, Any]) -> list[str]:
  """Distinct source lines with min_words..max_words words, in first-seen order."""
  cfg = data_cfg["seq2seq"]
  lo, hi = int(cfg["min_words"]), int(cfg["max_words"])
  if not 1 <= lo <= hi:
    raise ValueError(f"data.seq2seq.min_words={lo}, max_words={hi}: need 1 <= min <= max")
  docs = data_lib.read_documents(data_cfg["path"], text_key=data_cfg["text_key"],
                                 doc_separator=data_cfg["doc_separator"])
  lines = (" ".join(line.split()) for doc in docs for line in doc.splitlines())
  return list(dict.fromkeys(line for line in lines
                            if lo <= len(line.split()) <= hi and not line.endswith(":")))


def _jsonl_pairs(data_cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
  cfg = data_cfg["seq2seq"]
  src_key, tgt_key = cfg["source_key"], cfg["target_key"]
  pairs = []
  for path in data_lib.resolve_paths(data_cfg["path"]):
    if not path.endswith(data_lib.JSONL_SUFFIXES):
      raise ValueError(
          f"data.path file {path} is plain text, an LM-only dataset: data.task='seq2seq' needs "
          "(source, target) pairs; set data.seq2seq.transform (e.g. 'reverse_words') to build "
          "them from its lines, or point data.path at .jsonl files with "
          "data.seq2seq.source_key/target_key")
    for line_no, record in data_lib.iter_jsonl(path):
      values = [record.get(key) if isinstance(record, dict) else None
                for key in (src_key, tgt_key)]
      if not all(isinstance(v, str) and v.strip() for v in values):
        raise ValueError(f"{path}:{line_no}: a seq2seq record needs non-empty string fields "
                         f"{src_key!r} (data.seq2seq.source_key) and {tgt_key!r} "
                         "(data.seq2seq.target_key)")
      pairs.append(tuple(values))
  return pairs


def load_pairs(data_cfg: Mapping[str, Any], split: str) -> list[tuple[str, str]]:
  """The (source, target) text pairs of `split`, in data order."""
  if split not in data_lib.SPLITS:
    raise ValueError(f"split={split!r}; choose one of {data_lib.SPLITS}")
  transform = data_cfg["seq2seq"]["transform"]
  if transform:
    if transform not in TRANSFORMS:
      raise ValueError(f"data.seq2seq.transform={transform!r}; choose one of "
                       f"{sorted(TRANSFORMS)} or '' (pairs from .jsonl)")
    pairs = [(line, " ".join(TRANSFORMS[transform](line.split()))) for line in _lines(data_cfg)]
  else:
    pairs = _jsonl_pairs(data_cfg)
  val_fraction = float(data_cfg["val_fraction"])
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1)")
  want_val = split == "validation"
  pairs = [p for p in pairs if data_lib.is_validation(p[0], val_fraction) == want_val]
  if not pairs:
    raise ValueError(f"the {split} split of the seq2seq task on data.path={data_cfg['path']!r} "
                     "is empty")
  return pairs


def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
  """(sep, eos): the separator / decoder start token is BOS."""
  if tokenizer.bos_id is None or tokenizer.eos_id is None:
    raise ValueError("data.task='seq2seq' needs a tokenizer with BOS (the separator and "
                     "decoder start token) and EOS")
  return tokenizer.bos_id, tokenizer.eos_id


def encode_pairs(pairs, tokenizer: Tokenizer, *, arch: str, seq_len: int,
                 source_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """(source ids, target ids) per pair; raises naming the first pair that cannot fit `arch`'s
  rows (decoder: seq_len; encoder-decoder: source_len and seq_len)."""
  if arch not in ARCHS:
    raise ValueError(f"model.arch={arch!r} cannot train on data.task='seq2seq'; choose one of "
                     f"{ARCHS}")
  special_ids(tokenizer)
  examples = []
  for i, (source, target) in enumerate(pairs):
    src = np.asarray(tokenizer.encode(source, add_bos=False), np.int32)
    tgt = np.asarray(tokenizer.encode(target, add_bos=False), np.int32)
    if not len(src) or not len(tgt):
      raise ValueError(f"seq2seq example {i} has an empty source or target: {source!r}")
    if arch == "encoder_decoder" and len(src) > source_len:
      raise ValueError(f"seq2seq example {i} ({source!r}): its source is {len(src)} tokens, "
                       f"longer than the encoder length data.seq2seq.source_len={source_len}")
    needed = len(tgt) + 1 if arch == "encoder_decoder" else len(src) + len(tgt) + 1
    if needed > seq_len:
      raise ValueError(f"seq2seq example {i} ({source!r}) needs {needed} {arch} input tokens, "
                       f"more than seq_len={seq_len}")
    examples.append((src, tgt))
  return examples


def load_examples(data_cfg, tokenizer, split: str, *, arch: str, seq_len: int):
  return encode_pairs(load_pairs(data_cfg, split), tokenizer, arch=arch, seq_len=seq_len,
                      source_len=int(data_cfg["seq2seq"]["source_len"]))


# --- Rows: examples packed first-fit, several to a row ---


def example_fields(src: np.ndarray, tgt: np.ndarray, *, arch: str, sep_id: int,
                   eos_id: int) -> dict[str, np.ndarray]:
  """One example's unpadded fields (see module doc); `enc_` fields are [S], the rest [T]."""
  if arch in DECODER_ARCHS:
    seq = np.concatenate([src, [sep_id], tgt, [eos_id]]).astype(np.int32)
    n = len(seq) - 1
    # Input position len(src) (the separator) predicts the first target token.
    fields = {"inputs": seq[:-1], "targets": seq[1:],
              "loss_mask": (np.arange(n) >= len(src)).astype(np.int32)}
    if arch == "prefix_lm":
      fields["prefix"] = (np.arange(n) <= len(src)).astype(np.int32)
    return fields
  return {"inputs": np.concatenate([[sep_id], tgt]).astype(np.int32),
          "targets": np.concatenate([tgt, [eos_id]]).astype(np.int32),
          "loss_mask": np.ones(len(tgt) + 1, np.int32), "enc_inputs": src.astype(np.int32)}


class _Fields(grain.transforms.Map):

  def __init__(self, **kw):
    self._kw = kw

  def map(self, example):
    return example_fields(*example, **self._kw)


def _batch_fields(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # The packer numbers an example's segment alike in every field (the ith example of a row
  # is segment i in both), which is what the decoder's cross-attention matches on.
  batch = {k: v for k, v in packed.items() if not k.endswith(("_segment_ids", "_positions"))}
  batch["segment_ids"], batch["positions"] = packed["inputs_segment_ids"], packed["inputs_positions"]
  if "enc_inputs" in packed:
    batch["enc_segment_ids"] = packed["enc_inputs_segment_ids"]
    batch["enc_positions"] = packed["enc_inputs_positions"]
  return batch


def make_dataset(data_cfg: Mapping[str, Any], tokenizer: Tokenizer, *, arch: str, seq_len: int,
                 batch_size: int, split: str, seed: int, process_index: int | None = None,
                 process_count: int | None = None,
                 num_packing_bins: int | None = None) -> grain.IterDataset:
  """The batched seq2seq dataset of one split, as train/data.py make_dataset for an LM:
  train shuffles per epoch and repeats; validation is one pass, its last batch padded."""
  if seq_len < 2 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} must be >= 2 and batch_size={batch_size} >= 1")
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  source_len = int(data_cfg["seq2seq"]["source_len"])
  sep_id, eos_id = special_ids(tokenizer)
  examples = load_examples(data_cfg, tokenizer, split, arch=arch, seq_len=seq_len)
  ds = data_lib.document_dataset(examples, split=split, seed=seed, process_index=process_index,
                                 process_count=process_count)
  fields = ds.map(_Fields(arch=arch, sep_id=sep_id, eos_id=eos_id)).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  lengths = {k: source_len if k.startswith("enc_") else seq_len
             for k in example_fields(*examples[0], arch=arch, sep_id=sep_id, eos_id=eos_id)}
  bins = max(batch_size, 128) if num_packing_bins is None else num_packing_bins
  packed = grain.experimental.FirstFitPackIterDataset(
      fields, length_struct=lengths, num_packing_bins=bins, seed=seed,
      shuffle_bins=split == "train")
  if split == "train":
    batched = packed.batch(batch_size, drop_remainder=True)
  else:
    pad = functools.partial(grain.experimental.batch_and_pad, batch_size=batch_size)
    batched = packed.batch(batch_size, drop_remainder=False, batch_fn=pad)
  return batched.map(_batch_fields)


def tokenizer_texts(data_cfg: Mapping[str, Any]) -> list[str]:
  """The training split's sources and targets: what a BPE for this task is trained on."""
  return [text for pair in load_pairs(data_cfg, "train") for text in pair]
