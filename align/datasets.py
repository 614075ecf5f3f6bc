"""Alignment datasets: JSONL files -> train/validation splits -> grain pipelines of batches.

Splits: a record is held out iff `train.data.is_validation(key, val_fraction)`, key its
first user turn (`record_key`), so the split is stable across file order, process count and
added files, and records sharing a conversation opening land on one side. A non-empty `validation_path` replaces
the hash split: `path` is then all train and `validation_path` all validation.

Pipelines (`batch_size` is per process; like train/data.py each process takes every
process_count-th item of the, for train globally shuffled, stream; disjoint, covering):
  pair_dataset  one preference pair a row: chosen_* and rejected_* [B, T] fields, row b of
                both is pair b (so slicing rows keeps pairs together); `join_pairs` makes
                align/data.pair_batch's [2B, T] layout, `pair_valid` marks real pairs.
  sft_dataset   packed rows with align/data.pack_sft's fields and semantics.
Train repeats forever, shuffled, and drops the remainder; validation is one unshuffled pass
whose last batches are padded with empty rows (all fields 0), with the same number of
batches on every process (a collective eval step must not hang on one process).
Iterators support get_state()/set_state() (grain.checkpoint).
"""

import functools
import json
import os
from typing import Any, Mapping, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np

from align.data import (FIELDS, BadRecord, DataReport, empty_batch, pair_batch, parse_hh,
                        read_records, tokenize_pairs, tokenize_sft_records)
from train import decontam
from train.data import SPLITS, is_validation

PAIR_FIELDS = tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in FIELDS)
IN_MEMORY_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # in memory: no threads


# --- Splits and loaders ---


def record_key(record) -> str:
  """The stable string a record is split by: its conversation's first user turn when it has
  one, so the pairs hh-rlhf draws from one conversation opening all land on one side (a
  held-out prompt is never trained on); else its canonical JSON."""
  try:
    if "messages" in record:
      return next(m["content"] for m in record["messages"] if m["role"] == "user").strip()
    if "prompt" in record:
      prompt = record["prompt"]
      return (prompt if isinstance(prompt, str) else
              next(m["content"] for m in prompt if m["role"] == "user")).strip()
    return parse_hh(record["chosen"])[0]["content"]
  except (BadRecord, KeyError, TypeError, AttributeError, StopIteration):
    return json.dumps(record, sort_keys=True, ensure_ascii=False)


def _check_split(split: str, val_fraction: float) -> None:
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; choose one of {SPLITS}")
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1)")


def split_records(records, split: str, val_fraction: float):
  """The (where, record) items of `split`, in order (hash split on `record_key`)."""
  _check_split(split, val_fraction)
  want_val = split == "validation"
  for where, record in records:
    if is_validation(record_key(record), val_fraction) == want_val:
      yield where, record


def split_sources(data_cfg: Mapping[str, Any], split: str):
  """(paths, val_fraction) to read for `split`: val_fraction 0 keeps all records of the
  paths for train (none for validation); validation_path overrides the hash split."""
  val_fraction = float(data_cfg.get("val_fraction", 0.0))
  _check_split(split, val_fraction)
  validation_path = data_cfg.get("validation_path")
  if validation_path:
    return (validation_path if split == "validation" else data_cfg["path"]), 0.0
  return data_cfg["path"], val_fraction


def split_items(data_cfg, split: str, report: DataReport):
  """The records of one split (see `split_sources`), bad lines counted in `report`; train
  records of protected evaluation sets are refused (data.decontam)."""
  paths, val_fraction = split_sources(data_cfg, split)
  records = read_records(paths, report)
  if data_cfg.get("validation_path"):
    # Files used whole: the explicit validation files are all validation.
    items = records
  elif split == "validation" and val_fraction == 0.0:
    return iter(())
  else:
    items = split_records(records, split, val_fraction)
  if split != "train":
    return items
  items = list(items)
  # Refuses rows of protected evaluation sets (data.decontam; defaults when absent).
  decontam.check_records(data_cfg, items)
  return iter(items)


def load_pair_split(data_cfg: Mapping[str, Any], tokenizer, split: str):
  """(list of (chosen (ids, mask), rejected (ids, mask)), DataReport) of one split. Keys:
  path, val_fraction, max_len, optional validation_path and drop_turns (default True).
  Bad JSON lines have no record to hash: both splits' reports count them."""
  report = DataReport()
  pairs = tokenize_pairs(split_items(data_cfg, split, report), report, tokenizer,
                         int(data_cfg["max_len"]), bool(data_cfg.get("drop_turns", True)))
  return pairs, report


def load_sft_split(data_cfg: Mapping[str, Any], tokenizer, split: str):
  """(list of (ids, mask), DataReport) of one split; keys as `load_pair_split`."""
  report = DataReport()
  examples = tokenize_sft_records(split_items(data_cfg, split, report), report, tokenizer,
                                  int(data_cfg["max_len"]),
                                  bool(data_cfg.get("drop_turns", True)))
  return examples, report


def write_report(workdir: str, name: str, report: DataReport) -> str | None:
  """Writes WORKDIR/data_report_{name}.json (counts + samples) atomically, on process 0
  only; returns its path there, None elsewhere."""
  if jax.process_index() != 0:
    return None
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, f"data_report_{name}.json")
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({**report.as_dict(), "samples": report.samples}, f, indent=2, ensure_ascii=False)
  os.replace(tmp, path)  # readers never see a half-written report
  return path


# --- Shared pipeline pieces ---


def _check_args(batch_size: int, seq_len: int, split: str, process_index: int,
                process_count: int) -> None:
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; choose one of {SPLITS}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, {process_count})")


def padded_shard(items: list, empty, batch_size: int, process_index: int,
                 process_count: int) -> grain.MapDataset:
  """Validation: `items` padded with `empty` to a multiple of process_count * batch_size,
  then this process's every process_count-th one: one pass, the same number of batches on
  every process."""
  n = -len(items) % (process_count * batch_size)
  return grain.MapDataset.source(list(items) + [empty] * n)[process_index::process_count]


# --- Preference pairs ---


def _pair_row(item, seq_len: int) -> dict:
  """(pair, ref_2 or None) -> chosen_*/rejected_* [T] fields via pair_batch (its layout
  exactly), plus ref_chosen_logps/ref_rejected_logps scalars when the reference log-probs
  are cached; an empty pair () -> all 0."""
  pair, ref_2 = item
  rows_2T = pair_batch([pair], seq_len) if pair else empty_batch(2, seq_len)
  row = {f"{side}_{k}": rows_2T[k][i] for i, side in enumerate(("chosen", "rejected"))
         for k in FIELDS}
  if ref_2 is not None:
    row["ref_chosen_logps"], row["ref_rejected_logps"] = np.asarray(ref_2, np.float32)
  return row


def pair_dataset(pairs: Sequence[tuple], *, batch_size: int, seq_len: int, split: str,
                 seed: int, process_index: int = 0, process_count: int = 1,
                 ref_logps=None) -> grain.IterDataset:
  """Batches of PAIR_FIELDS, int32 [batch_size, seq_len]; see the module doc. `ref_logps`
  ([N, 2] float: the reference's chosen and rejected log-probs, cached once) adds float32
  [batch_size] fields ref_chosen_logps and ref_rejected_logps (0 for padding pairs)."""
  if ref_logps is not None and len(ref_logps) != len(pairs):
    raise ValueError(f"ref_logps has {len(ref_logps)} rows for {len(pairs)} pairs")
  refs = [None] * len(pairs) if ref_logps is None else [tuple(r) for r in ref_logps]
  pairs = list(zip(pairs, refs))
  _check_args(batch_size, seq_len, split, process_index, process_count)
  for b, ((chosen, rejected), _) in enumerate(pairs):  # fail now, not mid-run
    if not all(1 <= len(ids) - 1 <= seq_len for ids in (chosen[0], rejected[0])):
      raise ValueError(f"pair {b}: {len(chosen[0])}/{len(rejected[0])} tokens do not fit "
                       f"seq_len={seq_len}")
  if split == "validation":
    # (), not None: grain datasets treat a None element as filtered out.
    empty = ((), None if ref_logps is None else (0.0, 0.0))
    ds = padded_shard(pairs, empty, batch_size, process_index, process_count)
  elif not pairs:
    raise ValueError("pair_dataset: no training pairs")
  else:
    # Shuffle and repeat before sharding: one global order whatever the process count.
    ds = grain.MapDataset.source(pairs).shuffle(seed=seed).repeat()
    ds = ds[process_index::process_count]
  ds = ds.map(functools.partial(_pair_row, seq_len=seq_len))
  return ds.batch(batch_size, drop_remainder=True).to_iter_dataset(IN_MEMORY_READ)


def join_pairs(batch: Mapping[str, Any]) -> dict:
  """chosen_*/rejected_* [B, T] -> pair_batch's [2B, T]: chosen rows, then rejected rows.
  numpy in, numpy out; jax arrays (also under jit) use jnp."""
  xp = np if all(isinstance(v, np.ndarray) for v in batch.values()) else jnp
  return {k: xp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in FIELDS}


def pair_valid(batch: Mapping[str, Any]):
  """[B] float32: 1 for a real pair, 0 for a padding pair (its segment ids are all 0; a real
  row starts with segment 1)."""
  return (batch["chosen_segment_ids"][:, 0] != 0).astype(np.float32)


# --- SFT: packed rows ---


def _sft_fields(example) -> dict:
  ids_N, mask_N = example
  ids_N, mask_N = np.asarray(ids_N, np.int32), np.asarray(mask_N, np.int32)
  return {"inputs": ids_N[:-1], "targets": ids_N[1:], "loss_mask": mask_N[1:]}


def _from_packed(packed: dict) -> dict:
  # The three fields are packed together, so their segment ids and positions agree.
  return {"inputs": packed["inputs"], "targets": packed["targets"],
          "segment_ids": packed["inputs_segment_ids"], "positions": packed["inputs_positions"],
          "loss_mask": packed["loss_mask"]}


def _pack(ds: grain.IterDataset, seq_len: int, bins: int, seed: int,
          shuffle: bool) -> grain.IterDataset:
  packed = grain.experimental.FirstFitPackIterDataset(
      ds.map(_sft_fields),
      length_struct={"inputs": seq_len, "targets": seq_len, "loss_mask": seq_len},
      num_packing_bins=bins, seed=seed, shuffle_bins=shuffle)
  return packed.map(_from_packed)


def sft_dataset(examples: Sequence[tuple], *, batch_size: int, seq_len: int, split: str,
                seed: int, process_index: int = 0, process_count: int = 1,
                num_packing_bins: int | None = None) -> grain.IterDataset:
  """Batches of packed FIELDS rows, int32 [batch_size, seq_len] (pack_sft semantics: each
  example one whole segment 1, 2, ... of its row, positions from 0, loss_mask = mask[1:]).
  Validation packs all examples in order (eagerly: the split is small) and shards rows, so
  its batches do not depend on the process count."""
  _check_args(batch_size, seq_len, split, process_index, process_count)
  for i, (ids, _) in enumerate(examples):
    if not 1 <= len(ids) - 1 <= seq_len:
      raise ValueError(f"example {i}: {len(ids)} tokens do not fit seq_len={seq_len} "
                       "(need 2 to seq_len + 1)")
  bins = max(batch_size, 128) if num_packing_bins is None else num_packing_bins
  if split == "validation":
    ds = grain.MapDataset.source(list(examples)).to_iter_dataset(IN_MEMORY_READ)
    rows = list(_pack(ds, seq_len, bins, seed, shuffle=False))
    empty = {k: v[0] for k, v in empty_batch(1, seq_len).items()}
    ds = padded_shard(rows, empty, batch_size, process_index, process_count)
    return ds.batch(batch_size, drop_remainder=True).to_iter_dataset(IN_MEMORY_READ)
  if not examples:
    raise ValueError("sft_dataset: no training examples")
  ds = grain.MapDataset.source(list(examples)).shuffle(seed=seed).repeat()
  ds = ds[process_index::process_count].to_iter_dataset(IN_MEMORY_READ)
  return _pack(ds, seq_len, bins, seed, shuffle=True).batch(batch_size, drop_remainder=True)
