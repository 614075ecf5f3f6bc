"""Grain input pipeline: documents -> token ids -> packed [batch, seq_len] rows.

Every batch is a dict of int32 arrays of shape [batch_size, seq_len]:
  inputs       token ids fed to the model
  targets      the next token for each input position
  segment_ids  1, 2, ... per packed document (chunk) within a row; 0 = padding
  positions    position within the segment, restarting at 0 at each segment
Padding cells hold 0 in every field; mask the loss with `segment_ids != 0`.

The train split is shuffled per epoch and repeats forever. The validation split
is one unshuffled pass whose last batch is padded with all-padding rows (it is
never dropped), so every validation token is seen exactly once.

`batch_size` is per process. With process_count > 1 each process takes every
process_count-th document of the (globally shuffled, for train) document stream,
so shards are disjoint and together cover every document once per epoch.
"""

import functools
import glob
import gzip
import hashlib
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import grain
import jax
import numpy as np

from models.tokenizer import Tokenizer
from train import decontam

FIELDS = ("inputs", "targets", "segment_ids", "positions")
TASKS = ("lm", "seq2seq", "mlm")  # data.task: what a row of a batch asks the model to predict
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
SPLITS = ("train", "validation")


# --- Documents: reading files and the train/validation split ---


def resolve_paths(path: str | Sequence[str]) -> list[str]:
  """Expands a file, a glob, or a list of either into an ordered list of files.

  Raises FileNotFoundError naming the first entry that matches nothing.
  """
  entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
  if not entries:
    raise FileNotFoundError("data.path is empty: no input files given")
  files = []
  for entry in entries:
    entry = os.fspath(entry)
    if os.path.isfile(entry):
      files.append(entry)
      continue
    # Sorted so that document order (and hence the split and shuffle) does not
    # depend on the file system's listing order.
    matches = sorted(m for m in glob.glob(entry, recursive=True) if os.path.isfile(m))
    if not matches:
      raise FileNotFoundError(f"data.path {entry!r} matches no file")
    files.extend(matches)
  return files


def _read_text(path: str, doc_separator: str) -> list[str]:
  if not doc_separator:
    raise ValueError("data.doc_separator must be a non-empty string")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  return [doc for doc in text.split(doc_separator) if doc.strip()]


def iter_jsonl(path: str, on_bad_json=None):
  """(line number, record) for each non-blank line of a .jsonl(.gz) file. Bad JSON raises
  ValueError naming the file and line, or with `on_bad_json(line_no, message)` is handed
  to it and skipped."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if on_bad_json is None:
          raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from e
        on_bad_json(line_no, f"invalid JSON ({e.msg})")
        continue
      yield line_no, record


def _read_jsonl(path: str, text_key: str, skip_bad: bool = False) -> list[str]:
  """The `text_key` strings of a .jsonl file; a bad record raises ValueError naming the file
  and line, or with `skip_bad` is left out."""
  docs = []

  def bad(line_no, message):
    if not skip_bad:
      raise ValueError(f"{path}:{line_no}: {message}")

  for line_no, record in iter_jsonl(path, on_bad_json=bad if skip_bad else None):
    if not isinstance(record, dict) or text_key not in record:
      bad(line_no, f"no key {text_key!r} in this JSON record")
      continue
    text = record[text_key]
    if not isinstance(text, str):
      bad(line_no, f"{text_key!r} is a {type(text).__name__}, expected a string")
      continue
    if text.strip():
      docs.append(text)
  return docs


def read_documents(path: str | Sequence[str], *, text_key: str = "text",
                   doc_separator: str = "\n\n", skip_bad: bool = False) -> list[str]:
  """All non-empty documents of all files, in file order then in-file order; `skip_bad`
  leaves out JSONL records that do not parse or hold no `text_key` string (a tokenizer's
  training text: the task's own reader decides what bad records mean)."""
  docs = []
  for file in resolve_paths(path):
    if file.endswith(JSONL_SUFFIXES):
      docs.extend(_read_jsonl(file, text_key, skip_bad))
    elif file.endswith(TEXT_SUFFIXES):
      docs.extend(_read_text(file, doc_separator))
    else:
      raise ValueError(f"{file}: unsupported file type; expected one of "
                       f"{TEXT_SUFFIXES + JSONL_SUFFIXES}")
  return docs


def is_validation(doc: str, val_fraction: float) -> bool:
  """Hash-based assignment: depends only on the text, so it is stable across
  process counts, file order and added files; duplicates land on one side."""
  digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0**64 < val_fraction


def split_documents(docs: Iterable[str], split: str, val_fraction: float) -> list[str]:
  """The documents of one split, in their original order."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; choose one of {SPLITS}")
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1)")
  want_val = split == "validation"
  return [d for d in docs if is_validation(d, val_fraction) == want_val]


# --- The grain pipeline ---


def load_split(data_cfg: Mapping[str, Any], split: str, skip_bad: bool = False) -> list[str]:
  """The documents of `split` ("train" or "validation") named by `data_cfg` (`skip_bad`:
  read_documents')."""
  docs = read_documents(data_cfg["path"], text_key=data_cfg["text_key"],
                        doc_separator=data_cfg["doc_separator"], skip_bad=skip_bad)
  docs = split_documents(docs, split, float(data_cfg["val_fraction"]))
  if not docs:
    raise ValueError(f"the {split} split of data.path={data_cfg['path']!r} is empty "
                     f"(data.val_fraction={data_cfg['val_fraction']})")
  if split == "train":
    # Refuses documents holding protected evaluation rows (data.decontam; defaults when absent).
    read = functools.partial(read_documents, text_key=data_cfg["text_key"],
                             doc_separator=data_cfg["doc_separator"])
    decontam.check_documents(data_cfg, docs, resolve_paths(data_cfg["path"]), read)
  return docs


def document_dataset(docs: list[str], *, split: str, seed: int, process_index: int,
                     process_count: int) -> grain.MapDataset:
  """This process's documents: shuffled per epoch and endless for train."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, {process_count})")
  ds = grain.MapDataset.source(docs)
  if split == "train":
    # Shuffle and repeat before sharding: the global order is then the same for
    # any process count, and each epoch every document is read by one process.
    ds = ds.shuffle(seed=seed).repeat()
  return ds[process_index::process_count]


class _Encode(grain.transforms.Map):
  """Document text -> [bos] + ids + [eos] as an int32 array."""

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer

  def map(self, doc: str) -> np.ndarray:
    tok = self._tokenizer
    # add_bos=False: BOS is added here whatever the wrapper's default.
    ids = tok.encode(doc, add_bos=False)
    if tok.bos_id is not None:
      ids = [tok.bos_id] + ids
    if tok.eos_id is not None:
      ids = ids + [tok.eos_id]
    return np.asarray(ids, dtype=np.int32)


class _ChunkPairs(grain.experimental.FlatMapTransform):
  """Token ids -> (inputs, targets) pairs cut into chunks of at most seq_len."""

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    # Only MapDataset flat maps use max_fan_out; we flat-map an IterDataset.
    self.max_fan_out = 1

  def flat_map(self, ids: np.ndarray) -> list[dict[str, np.ndarray]]:
    inputs, targets = ids[:-1], ids[1:]  # a one-token document yields nothing
    return [{"inputs": inputs[i:i + self.seq_len], "targets": targets[i:i + self.seq_len]}
            for i in range(0, len(inputs), self.seq_len)]


def _to_batch_fields(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # inputs and targets are packed identically, so their segment ids and
  # positions agree; keep one copy.
  return {"inputs": packed["inputs"], "targets": packed["targets"],
          "segment_ids": packed["inputs_segment_ids"],
          "positions": packed["inputs_positions"]}


def make_dataset(data_cfg: Mapping[str, Any], tokenizer: Tokenizer, *, seq_len: int,
                 batch_size: int, split: str, seed: int, process_index: int | None = None,
                 process_count: int | None = None,
                 num_packing_bins: int | None = None) -> grain.IterDataset:
  """The batched, packed dataset of one split for this process (see module doc).

  `num_packing_bins` (default max(batch_size, 128)) is how many rows grain's
  first-fit packer fills at once; more rows leave less padding.

  Deterministic given (data, tokenizer, seed, process_index, process_count).
  `iter()` of the result supports get_state()/set_state() and grain.checkpoint.
  """
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; choose one of {SPLITS}")
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  train = split == "train"

  docs = load_split(data_cfg, split)
  ds = document_dataset(docs, split=split, seed=seed, process_index=process_index,
                        process_count=process_count)
  # num_threads=0: the documents are in memory and tokenizing is cheap, so
  # reader threads would only contend for the GIL.
  ids = ds.map(_Encode(tokenizer)).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  pairs = grain.experimental.FlatMapIterDataset(ids, _ChunkPairs(seq_len))
  # On tinyshakespeare at seq_len 256, 8 bins leave 7% padding, 128 bins 1.5%.
  # Shuffling the packed rows spreads a round's long documents over batches.
  bins = max(batch_size, 128) if num_packing_bins is None else num_packing_bins
  packed = grain.experimental.FirstFitPackIterDataset(
      pairs, length_struct={"inputs": seq_len, "targets": seq_len},
      num_packing_bins=bins, seed=seed, shuffle_bins=train)
  if train:
    batched = packed.batch(batch_size, drop_remainder=True)
  else:
    pad = functools.partial(grain.experimental.batch_and_pad, batch_size=batch_size)
    batched = packed.batch(batch_size, drop_remainder=False, batch_fn=pad)
  return batched.map(_to_batch_fields)
