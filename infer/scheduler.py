"""Continuous batching: which sequences compute which tokens at each engine step.

Every step the scheduler spends a token budget: first on the running
sequences, oldest first (one token for a decoding sequence, a chunk of at
most `prefill_chunk` for one still reading its prompt: chunked prefill), then
on admitting waiting sequences, first come first served, while a batch slot
and blocks are free. A sequence's first blocks may come from the prefix cache
(infer/block_manager.py). When a running sequence needs a block and none is
free, the newest running sequence is preempted by recompute: its blocks are
freed and it goes back to the head of the queue with its generated tokens
appended to what it must recompute; its output does not change.
"""

import collections
import dataclasses
import time

from infer.block_manager import BlockManager, SeqBlocks


class Sequence:
  """One request as the scheduler sees it. `request` is its host-side state
  (infer/requests.py `Request`)."""

  def __init__(self, rid: int, request):
    self.rid, self.request = rid, request
    self.blocks = SeqBlocks()
    self.num_computed = 0  # tokens whose keys and values are in the cache
    self.first_token_time: float | None = None
    self.finish_time: float | None = None

  @property
  def token_ids(self) -> list[int]:
    """Every token known so far: the prompt and what was generated."""
    return self.request.prompt_ids + self.request.token_ids

  @property
  def remaining(self) -> int:
    return len(self.request.prompt_ids) + len(self.request.token_ids) - self.num_computed


@dataclasses.dataclass
class Work:
  """One step's plan: (sequence, number of tokens to compute) pairs."""
  chunks: list[tuple[Sequence, int]]
  preempted: list[Sequence]


@dataclasses.dataclass
class SchedulerCounters:
  running: int = 0
  waiting: int = 0
  preemptions: int = 0
  admitted: int = 0
  finished: int = 0
  aborted: int = 0
  steps: int = 0
  prefill_tokens: int = 0
  decode_tokens: int = 0
  cached_prompt_tokens: int = 0


class Scheduler:
  """Admits, schedules and preempts sequences; see the module docstring."""

  def __init__(self, blocks: BlockManager, max_batch: int, token_budget: int,
               prefill_chunk: int):
    if token_budget < max_batch:
      raise ValueError(f"token_budget={token_budget} must be >= max_batch={max_batch}: every "
                       "running sequence needs one token per step")
    if prefill_chunk < 1:
      raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
    self.blocks, self.max_batch = blocks, max_batch
    self.token_budget, self.prefill_chunk = token_budget, prefill_chunk
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []
    self.counters = SchedulerCounters()

  def add(self, seq: Sequence) -> None:
    # The last sampled token is never written to the cache.
    need = self.blocks.blocks_for(len(seq.token_ids) + seq.request.params.max_tokens - 1)
    if need > self.blocks.num_blocks:
      raise ValueError(f"request needs up to {need} KV blocks but the pool has "
                       f"{self.blocks.num_blocks}")
    self.waiting.append(seq)
    self._count()

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def schedule(self) -> Work:
    budget = self.token_budget
    chunks, preempted = [], []
    for seq in list(self.running):
      if seq not in self.running or budget == 0:
        continue  # preempted earlier in this loop
      n = min(seq.remaining, budget, self.prefill_chunk)
      while not self.blocks.can_grow(seq.blocks, seq.num_computed + n):
        victim = self.running[-1]
        self._preempt(victim)
        preempted.append(victim)
        chunks = [(s, k) for s, k in chunks if s is not victim]
        if victim is seq:
          break
      if seq in self.running:
        self.blocks.grow(seq.blocks, seq.num_computed + n)
        chunks.append((seq, n))
        budget -= n
    budget = self.token_budget - sum(n for _, n in chunks)
    while (not preempted and self.waiting and len(self.running) < self.max_batch and budget > 0):
      seq = self.waiting[0]
      cached = self.blocks.match_prefix(seq.blocks, seq.token_ids)
      n = min(len(seq.token_ids) - cached, budget, self.prefill_chunk)
      if not self.blocks.can_grow(seq.blocks, cached + n):
        self.blocks.free_seq(seq.blocks)
        break
      self.blocks.count_prefix(seq.token_ids, cached)
      self.blocks.grow(seq.blocks, cached + n)
      self.waiting.popleft()
      seq.num_computed = cached
      self.counters.cached_prompt_tokens += cached
      self.counters.admitted += 1
      self.running.append(seq)
      chunks.append((seq, n))
      budget -= n
    self.counters.steps += 1
    for seq, n in chunks:
      if seq.remaining == 1 and seq.request.token_ids:
        self.counters.decode_tokens += n
      else:
        self.counters.prefill_tokens += n
    self._count()
    return Work(chunks, preempted)

  def computed(self, seq: Sequence, n: int) -> None:
    """Records that `n` more tokens of `seq` are in the cache; seals the blocks they fill."""
    seq.num_computed += n
    self.blocks.seal(seq.blocks, seq.token_ids, seq.num_computed)

  def finish(self, seq: Sequence) -> None:
    seq.finish_time = time.perf_counter()
    self.running.remove(seq)
    self.blocks.free_seq(seq.blocks)
    self.counters.finished += 1
    self._count()

  def abort(self, seq: Sequence) -> None:
    """Forgets an unfinished sequence, running or waiting, and frees its blocks."""
    if seq in self.running:
      self.running.remove(seq)
    elif seq in self.waiting:
      self.waiting.remove(seq)
    self.blocks.free_seq(seq.blocks)
    self.counters.aborted += 1
    self._count()

  def _preempt(self, seq: Sequence) -> None:
    self.running.remove(seq)
    self.blocks.free_seq(seq.blocks)
    seq.num_computed = 0
    self.waiting.appendleft(seq)
    self.counters.preemptions += 1

  def _count(self):
    self.counters.running, self.counters.waiting = len(self.running), len(self.waiting)
