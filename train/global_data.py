"""The global dataset of a run: `data.task` picks the rows (packed documents, masked
documents or seq2seq pairs), and each process builds its shards of the global batch."""

import functools
from typing import Any, Mapping

import grain
import jax
import numpy as np

from models.tokenizer import Tokenizer
from train import data as data_lib
from train import mlm_data, seq2seq_data


def concat_rows(batches: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def make_global_dataset(data_cfg: Mapping[str, Any], tokenizer: Tokenizer, *, seq_len: int,
                        global_batch_size: int, split: str, seed: int,
                        num_shards: int = 0, arch: str = "decoder",
                        vocab_size: int = 0) -> grain.IterDataset:
  """This process's rows of each global batch, the same whatever the process count.

  The documents are dealt into `num_shards` shards (0: one per process); each
  process packs only the shards it owns, and a global batch is the shards' rows
  in shard order. With `num_shards` fixed, one process x 8 devices sees exactly
  the batches that two processes x 4 devices see. Zipped validation shards end
  with the shortest one. `data_cfg.task` "seq2seq" makes train/seq2seq_data.py's rows
  for model.arch `arch`; "mlm" masked packed documents (train/mlm_data.py; `vocab_size`:
  the model's); "lm" (the default) packed documents.
  """
  task = data_cfg.get("task", "lm")
  if task == "seq2seq":
    make = functools.partial(seq2seq_data.make_dataset, arch=arch)
  elif task == "mlm":
    make = functools.partial(mlm_data.make_dataset, vocab_size=vocab_size)
  elif task == "lm":
    if arch in ("encoder_decoder", "encoder"):
      raise ValueError(f"model.arch={arch!r} does not train on next-token prediction: set "
                       f"data.task={'seq2seq' if arch == 'encoder_decoder' else 'mlm'!r}")
    make = data_lib.make_dataset
  else:
    raise ValueError(f"data.task={task!r}; choose one of {data_lib.TASKS}")
  count, index = jax.process_count(), jax.process_index()
  shards = num_shards or count
  if shards % count or global_batch_size % shards:
    raise ValueError(f"data.num_shards={shards} must be a multiple of the {count} process(es) "
                     f"and divide batch_size={global_batch_size}")
  owned = range(index * shards // count, (index + 1) * shards // count)
  parts = [make(data_cfg, tokenizer, seq_len=seq_len, batch_size=global_batch_size // shards,
                split=split, seed=seed, process_index=s, process_count=shards) for s in owned]
  if len(parts) == 1:
    return parts[0]
  return grain.experimental.ZipIterDataset(parents=parts, strict=False).map(concat_rows)
