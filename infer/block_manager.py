"""Host-side bookkeeping of the paged KV pool: free list, reference counts, prefix cache.

Pages (blocks) 1..num_blocks are handed out; page 0 is the null page
(infer/paged.py). A full block whose tokens are all computed is *sealed*: it
gets a content hash chained from its predecessor's (sha256 over the parent
hash and the block's token ids), so equal prefixes give equal hashes. A
request whose prompt starts with sealed blocks shares them (reference count
+1) instead of recomputing them: prefix caching. A block whose count drops to
zero goes to the back of the free list but keeps its hash until it is handed
out again, so a prefix can be found even after its last user finished (the
free list is then an LRU of cached blocks).
"""

import collections
import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass
class BlockCounters:
  prefix_queries: int = 0   # full prompt blocks looked up, over admitted requests
  prefix_hits: int = 0      # of which found in the cache
  allocated: int = 0        # blocks handed out from the free list
  evicted: int = 0          # cached blocks reused for other content


class SeqBlocks:
  """One sequence's pages: its block table and how many of its leading blocks are sealed."""

  def __init__(self):
    self.blocks: list[int] = []
    self.hashes: list[bytes] = []  # hashes of the sealed blocks, in order


class BlockManager:
  """Allocates fixed-size blocks from a free list; see the module docstring."""

  def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
    if num_blocks < 1 or block_size < 1:
      raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
    self.ref = np.zeros(num_blocks + 1, np.int32)
    self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
        range(1, num_blocks + 1))
    self.hash_of: dict[int, bytes] = {}
    self.cached: dict[bytes, int] = {}
    self.counters = BlockCounters()
    self.peak_used = 0

  @property
  def num_free(self) -> int:
    return len(self.free)

  @property
  def num_used(self) -> int:
    return self.num_blocks - len(self.free)

  def blocks_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.block_size)

  def match_prefix(self, seq: SeqBlocks, token_ids: list[int]) -> int:
    """Shares the cached blocks `token_ids` starts with; returns how many tokens they cover.

    At least the last token is left to compute (its logits are needed), and
    only whole blocks are shared, so a shared block is never written to.
    """
    assert not seq.blocks, "match_prefix is for a sequence with no blocks yet"
    if not self.prefix_caching:
      return 0
    parent = b""
    for i in range((len(token_ids) - 1) // self.block_size):
      h = self._hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
      block = self.cached.get(h)
      if block is None:
        break
      if self.ref[block] == 0:
        del self.free[block]
      self.ref[block] += 1
      seq.blocks.append(block)
      seq.hashes.append(h)
      parent = h
    self._note_peak()
    return len(seq.blocks) * self.block_size

  def count_prefix(self, token_ids: list[int], cached_tokens: int) -> None:
    """Counts one admitted request's prefix lookup (failed admissions are retried, not counted)."""
    if self.prefix_caching:
      self.counters.prefix_queries += (len(token_ids) - 1) // self.block_size
      self.counters.prefix_hits += cached_tokens // self.block_size

  def can_grow(self, seq: SeqBlocks, n_tokens: int) -> bool:
    return self.blocks_for(n_tokens) - len(seq.blocks) <= self.num_free

  def grow(self, seq: SeqBlocks, n_tokens: int) -> None:
    """Gives `seq` enough blocks for `n_tokens` tokens in all (check can_grow first)."""
    need = self.blocks_for(n_tokens) - len(seq.blocks)
    if need > self.num_free:
      raise RuntimeError(f"{need} blocks needed, {self.num_free} free")
    for _ in range(need):
      block, _ = self.free.popitem(last=False)  # least recently freed first
      old = self.hash_of.pop(block, None)
      if old is not None:
        del self.cached[old]
        self.counters.evicted += 1
      self.ref[block] = 1
      seq.blocks.append(block)
      self.counters.allocated += 1
    self._note_peak()

  def seal(self, seq: SeqBlocks, token_ids: list[int], num_computed: int) -> None:
    """Hashes the blocks that `num_computed` tokens fill completely, making them shareable."""
    full = min(num_computed // self.block_size, len(seq.blocks))
    while len(seq.hashes) < full:
      i = len(seq.hashes)
      parent = seq.hashes[-1] if seq.hashes else b""
      h = self._hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
      seq.hashes.append(h)
      block = seq.blocks[i]
      if self.prefix_caching and h not in self.cached and block not in self.hash_of:
        self.cached[h] = block
        self.hash_of[block] = h

  def free_seq(self, seq: SeqBlocks) -> None:
    """Drops the sequence's references; unreferenced blocks return to the free list."""
    # Last blocks first, so a prefix's head outlives its tail in the LRU order.
    for block in reversed(seq.blocks):
      self.ref[block] -= 1
      if self.ref[block] == 0:
        self.free[block] = None
    seq.blocks, seq.hashes = [], []

  def table(self, seq: SeqBlocks, width: int) -> list[int]:
    """The block table padded with the null page to `width` entries."""
    return seq.blocks + [0] * (width - len(seq.blocks))

  def _note_peak(self):
    self.peak_used = max(self.peak_used, self.num_used)

  @staticmethod
  def _hash(parent: bytes, token_ids) -> bytes:
    return hashlib.sha256(parent + np.asarray(token_ids, np.int64).tobytes()).digest()
