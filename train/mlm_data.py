"""Masked-LM batches for encoder-only models (data.task="mlm"), BERT's recipe.

The packed LM pipeline (train/data.py) supplies rows of real text; each real
token is chosen with probability `data.mlm.mask_prob` (15%) and, of those, 80%
become the mask token, 10% a random token and 10% stay. Targets are the
original tokens and `loss_mask` marks the chosen ones, so train/step.py's one
loss serves. The choice is drawn by grain's `random_map` from the run seed, so
it is deterministic and restored with the iterator on resume.

The mask id: the tokenizer's own `[MASK]`/`<mask>` token if it has one, else
the first id past its vocabulary, which the model must then have room for
(model.vocab_size > tokenizer size).
"""

from typing import Any, Mapping

import grain
import numpy as np

from models import ConfigError, Tokenizer
from train import data

MASK_TOKENS = ("[MASK]", "<mask>")


def mask_id(tokenizer: Tokenizer, model_vocab_size: int) -> int:
  """The id masked positions get (see the module docstring); raises ConfigError if none fits."""
  for token in MASK_TOKENS:
    found = tokenizer.tok.token_to_id(token)
    if found is not None:
      return int(found)
  if tokenizer.vocab_size >= model_vocab_size:
    raise ConfigError(f"data.task='mlm' needs a mask token: the tokenizer has none of "
                      f"{MASK_TOKENS} and fills model.vocab_size={model_vocab_size}; set "
                      f"model.vocab_size > {tokenizer.vocab_size} to reserve one")
  return tokenizer.vocab_size


class MaskTokens(grain.transforms.RandomMap):
  """An LM batch -> an MLM batch: inputs masked, targets = the original inputs, loss_mask."""

  def __init__(self, mask: int, random_vocab: int, mask_prob: float):
    if not 0 < mask_prob < 1:
      raise ConfigError(f"data.mlm.mask_prob={mask_prob} must be in (0, 1)")
    self.mask, self.random_vocab, self.mask_prob = mask, random_vocab, mask_prob

  def random_map(self, batch: dict[str, np.ndarray], rng: np.random.Generator):
    tokens_BT = batch["inputs"]
    real_BT = batch["segment_ids"] > 0
    chosen_BT = (rng.random(tokens_BT.shape) < self.mask_prob) & real_BT
    roll_BT = rng.random(tokens_BT.shape)
    inputs_BT = np.where(chosen_BT & (roll_BT < 0.8), self.mask, tokens_BT)
    swap_BT = chosen_BT & (roll_BT >= 0.8) & (roll_BT < 0.9)
    inputs_BT = np.where(swap_BT, rng.integers(0, self.random_vocab, tokens_BT.shape), inputs_BT)
    return dict(batch, inputs=inputs_BT.astype(np.int32), targets=tokens_BT,
                loss_mask=chosen_BT.astype(np.int32))


def make_dataset(data_cfg: Mapping[str, Any], tokenizer: Tokenizer, *, vocab_size: int,
                 seed: int, **lm_kwargs) -> grain.IterDataset:
  """train/data.py's packed LM batches (same keyword arguments), masked for MLM."""
  lm = data.make_dataset(data_cfg, tokenizer, seed=seed, **lm_kwargs)
  mlm = data_cfg.get("mlm", {})
  masker = MaskTokens(mask_id(tokenizer, vocab_size), tokenizer.vocab_size,
                      float(mlm.get("mask_prob", 0.15)))
  # The masks of shard p differ from shard q's: the seed carries the shard index.
  return lm.random_map(masker, seed=seed * 1_000_003 + lm_kwargs.get("process_index", 0))
