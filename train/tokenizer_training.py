"""Trains a small byte-level BPE tokenizer; unigram entropy as a loss baseline."""

import collections
import math
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from models.tokenizer import Tokenizer

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
_NUM_BYTES = 256


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """Byte-level BPE over `texts` with <|bos|>, <|eos|>, <|pad|> as ids 0, 1, 2.

  Any byte string round-trips (all 256 bytes are in the base alphabet). The
  result is a pure function of (texts, vocab_size). `add_bos` is True because
  make_dataset starts every training document with BOS, so prompts encoded for
  generation should start with it too.
  """
  min_size = _NUM_BYTES + len(SPECIAL_TOKENS)
  if vocab_size < min_size:
    raise ValueError(f"vocab_size={vocab_size} is below the byte-level minimum {min_size}")
  tok = tokenizers.Tokenizer(models.BPE())
  # add_prefix_space=False: a document's first word must not change with the
  # tokenizer; decode then gives back exactly the encoded text.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
  tok.train_from_iterator(texts, trainer=trainer)
  ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
  return Tokenizer(tok, bos_id=ids[0], eos_id=ids[1], pad_id=ids[2], add_bos=True)


def unigram_entropy(token_id_lists: Iterable[Sequence[int]]) -> float:
  """Entropy in nats/token of the empirical unigram distribution of the ids.

  This is the cross-entropy of the best context-free model on this very data,
  so a language model's validation loss should end up below it.
  """
  counts = collections.Counter()
  for ids in token_id_lists:
    counts.update(int(i) for i in ids)
  total = sum(counts.values())
  if total == 0:
    raise ValueError("unigram_entropy needs at least one token")
  return -sum(c / total * math.log(c / total) for c in counts.values())
