"""`PagedEngine`: continuous batching over a paged KV cache, with chunked prefill.

    engine = PagedEngine(model, tokenizer, max_seq_len=1024, max_batch=8)
    results = engine.generate(prompts, SamplingParams(max_tokens=64))   # like Engine
    rid = engine.add_request("Hi", SamplingParams())                    # or drive it
    while engine.has_work:
      for rid, token in engine.step(): ...

Each step runs what infer/scheduler.py planned: a jitted call per power-of-two
chunk length for the sequences still reading their prompts (chunks
right-padded to that length) and one for the decoding ones (one token each,
`max_batch` rows). `precompile()` compiles every such shape ahead. A
finished request frees its slot and blocks at once, and a waiting one takes
them at the next step: no request waits for the longest in its batch.
`kv_dtype="int8"` keeps the pool as int8 pages with per-token scales. On
CPU, decode steps read a flat list of the pages in use instead of block tables
padded to the widest row (infer/ragged.py; `ragged_decode`), and with a float
pool they run the layers unrolled as Engine's do (`unroll_layers`), each layer
writing its keys and values into its pool pages in place; prefill steps scan.

Outputs equal the contiguous Engine's: same model code, same sampler, and a
request's randomness depends on its seed and token index only, so batching,
chunking and preemption change nothing but speed.
"""

import collections
import functools
import time
from typing import Iterator, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import parallel
from infer import kv_cache, paged, ragged
from infer.block_manager import BlockManager
from infer.engine import Engine
from infer.requests import Result, Token, batch_of_requests
from infer.sampling import MAX_TOP_LOGPROBS, RowParams, SamplingParams, sample
from infer.scheduler import Scheduler, Sequence
from models import layer_weights


@functools.partial(jax.jit, static_argnames=("graphdef", "top_n"), donate_argnames=("pool",))
def _step(graphdef, weights, pool, tokens_BT, segment_ids_BT, start_B, pages, seen_BV, rows,
          step_B, top_n=0):
  """`weights`: the state, or LayerWeights (unrolled); `pages`: the rows' block tables
  [B, Y], or the flat RaggedPages of a ragged decode."""
  model = layer_weights.merge(graphdef, weights)
  if isinstance(pages, paged.RaggedPages):
    logits_BV, pool = paged.forward(model, pool, tokens_BT, segment_ids_BT, start_B, None,
                                    ragged=pages)
  else:
    logits_BV, pool = paged.forward(model, pool, tokens_BT, segment_ids_BT, start_B, pages)
  token_B, logprob_B = sample(logits_BV, seen_BV, rows, step_B)
  top = None
  if top_n:  # compiled only for batches that ask for alternatives
    top = jax.lax.top_k(jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1), top_n)
  return token_B, logprob_B, pool, top


def _pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


class PagedEngine(Engine):
  """Continuous batching with a paged KV cache; see the module docstring."""

  ARCHS = ("decoder",)  # pages hold no prefix marks or position bias

  def __init__(self, model, tokenizer, max_seq_len: int | None = None, max_batch: int = 8, *,
               block_size: int = 16, num_blocks: int | None = None, token_budget: int = 512,
               prefill_chunk: int = 256, prefix_caching: bool = True,
               kv_dtype: str | None = None, ragged_decode: bool | None = None,
               unroll_layers: bool | None = None):
    # decode steps run unrolled as Engine's do (`unroll_layers`); prefill steps scan
    super().__init__(model, tokenizer, max_seq_len, max_batch, kv_dtype=kv_dtype,
                     unroll_layers=unroll_layers)
    if model.cfg.position == "relative":
      raise ValueError("PagedEngine has no relative position bias (T5 buckets); serve this "
                       "model with infer.Engine")
    if not (isinstance(block_size, int) and block_size >= 1):
      raise ValueError(f"block_size={block_size!r} must be a positive integer")
    self.block_size = block_size
    self.max_blocks = -(-self.max_seq_len // block_size)
    num_blocks = max_batch * self.max_blocks if num_blocks is None else num_blocks
    self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
    self.scheduler = Scheduler(self.blocks, max_batch, token_budget, prefill_chunk)
    self._pool_args = (model.cfg, num_blocks + 1, block_size, kv_dtype)
    self.pool = paged.init_pool(*self._pool_args)
    self.page_bytes = paged.page_bytes(model.cfg, block_size, kv_dtype)
    self.cache_bytes = (num_blocks + 1) * self.page_bytes  # the whole pool, null page included
    self._next_id = 0
    self.sequences: dict[int, Sequence] = {}
    self._streams: dict[int, collections.deque] = {}
    self._compiled: dict[tuple[int, int, int, int], object] = {}  # precompile()'s executables
    if ragged_decode and kv_dtype is not None:
      raise ValueError(f"ragged_decode reads a float pool in place; kv_dtype={kv_dtype!r} pages "
                       "are read through block tables")
    if ragged_decode is None:  # CPU, where it was measured faster; the TPU has its kernel
      ragged_decode = kv_dtype is None and parallel.platform() == "cpu"
    self.ragged_decode = ragged_decode
    self.ragged_steps = 0

  # ---- driving it one step at a time ----

  def add_request(self, prompt, params: SamplingParams | None = None) -> int:
    """Queues a request; raises ValueError naming the limit it breaks. Returns its id."""
    return self._queue(self._request(prompt, params or SamplingParams()))

  def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
    """Engine's checks, and that the pool can hold the request at its longest."""
    super().check(prompt_ids, params)
    need = self.blocks.blocks_for(len(prompt_ids) + params.max_tokens - 1)
    if need > self.blocks.num_blocks:
      raise ValueError(f"request needs up to {need} KV blocks but the pool has "
                       f"{self.blocks.num_blocks}")

  def _queue(self, request) -> int:
    seq = Sequence(self._next_id, request)
    self.scheduler.add(seq)
    self.sequences[seq.rid] = seq
    self._next_id += 1
    return seq.rid

  def release(self, rid: int) -> Result:
    """A finished request's Result; the engine forgets it (requests driven by `step` must be
    released, or they stay in `sequences`)."""
    if not self.sequences[rid].request.done:
      raise ValueError(f"request {rid} has not finished")
    return self.sequences.pop(rid).request.result()

  def abort(self, rid: int) -> None:
    """Drops a request, finished or not (its client went away): its KV blocks are freed now."""
    seq = self.sequences.pop(rid, None)
    self._streams.pop(rid, None)
    if seq is not None and not seq.request.done:
      self.scheduler.abort(seq)

  @property
  def has_work(self) -> bool:
    return self.scheduler.has_work

  def reset(self) -> None:
    """Drops every request and builds a fresh KV pool (after a step failed part way, its
    donated pool may be gone); the engine then serves new requests as before."""
    for rid in list(self.sequences):
      self.abort(rid)
    b = self.blocks
    self.blocks = BlockManager(b.num_blocks, b.block_size, b.prefix_caching)
    s = self.scheduler
    self.scheduler = Scheduler(self.blocks, s.max_batch, s.token_budget, s.prefill_chunk)
    self.scheduler.counters = s.counters
    self.pool = None  # the old pool (if a failed step left it) goes before the new one comes
    self.pool = paged.init_pool(*self._pool_args)

  def step(self) -> list[tuple[int, Token]]:
    """Runs one scheduled step; returns the tokens it produced as (request id, Token)."""
    work = self.scheduler.schedule()
    decodes = [(s, n) for s, n in work.chunks if n == 1]
    # Prefill chunks padded to one length: a group per power-of-two length keeps the padding
    # (computed like real tokens) under half of each call, and the group's length is
    # `_chunk_len` of its longest chunk (a lone chunk of 16 tokens or more, the common case,
    # pads under 25%).
    by_length = collections.defaultdict(list)
    for s, n in work.chunks:
      if n > 1:
        by_length[_pow2(n, 16)].append((s, n))
    groups = [(g, _pow2(len(g))) for _, g in sorted(by_length.items())]
    events = []
    for group, rows in groups + [(decodes, self.max_batch)]:
      if group:
        events += self._run_group(group, rows)
    for rid, token in events:
      if rid in self._streams:
        self._streams[rid].append(token)
    return events

  def step_shapes(self) -> list[tuple[int, int, int, int]]:
    """Every (rows, tokens, table width, ragged entries) a step can run: prefill groups (rows
    in powers of two, `_chunk_len`'s lengths) and the decode batch (block-table widths in
    powers of two, or with ragged_decode flat lists of entries (infer/ragged.py) in
    kv_cache.bucket's lengths). One of width and entries is 0."""
    lengths = sorted({self._chunk_len(n) for n in range(2, self._longest_chunk + 1)})
    shapes = [(1 << i, t, self.max_blocks, 0) for t in lengths
              for i in range(_pow2(self.max_batch).bit_length())]
    widths = sorted({min(_pow2(n, 4), self.max_blocks) for n in range(1, self.max_blocks + 1)})
    if not self.ragged_decode:
      return shapes + [(self.max_batch, 1, w, 0) for w in widths]
    # A page shared through the prefix cache is listed once per row that reads it, so the
    # list may be longer than the pool: every length up to rows x widest table's entries.
    caps = {self._ragged_cap(self.max_batch, w) for w in widths}
    sizes = {self._ragged_size(n, cap) for cap in caps for n in range(1, cap + 1)}
    return shapes + [(self.max_batch, 1, 0, size) for size in sorted(sizes)]

  @property
  def _longest_chunk(self) -> int:
    return min(self.scheduler.prefill_chunk, self.max_seq_len)

  def _chunk_len(self, n: int) -> int:
    """A prefill group's padded length for chunks of up to n tokens: kv_cache.bucket's
    (under 25% padding, four lengths per doubling; powers of two padded a 65-token chunk to
    128, and a prefill's time grows with its padded length). More lengths, more shapes to
    compile: 17 up to 256 tokens instead of 5 (docs/notes/cpu_decode.md, row 3)."""
    return kv_cache.bucket(n, self._longest_chunk, 16)

  @staticmethod
  def _ragged_size(entries: int, cap: int) -> int:
    """The flat list's length for a decode step: kv_cache.bucket's lengths (under 25%
    padding), at most `_ragged_cap`, which always holds every entry in use."""
    return kv_cache.bucket(entries, cap, 8)

  @staticmethod
  def _ragged_cap(rows: int, width: int) -> int:
    """Entries (infer/ragged.py: GROUP pages each) of `rows` block tables `width` wide."""
    return rows * -(-width // ragged.GROUP)

  def precompile(self) -> int:
    """Compiles every step shape ahead of traffic (a server's warm-up), so that no request
    waits for XLA mid-stream; returns how many shapes. Steps with top-logprobs still compile
    on first use."""
    for rows, t, width, size in tqdm.tqdm(self.step_shapes(), desc="compiling step shapes",
                                          unit="shape", leave=False, disable=None):
      if (rows, t, width, size) in self._compiled:
        continue
      zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
      pages = (paged.RaggedPages(zeros(size, ragged.GROUP), zeros(size), zeros(size)) if size
               else zeros(rows, width))
      args = (zeros(rows, t), zeros(rows, t), zeros(rows), pages,
              zeros(rows, self.vocab_size, dtype=bool), RowParams.stack([SamplingParams()] * rows),
              zeros(rows))
      self._compiled[(rows, t, width, size)] = _step.lower(
          self.graphdef, self._step_weights(t), self.pool, *args, top_n=0).compile()
    return len(self._compiled)

  def counters(self) -> dict:
    """Running/waiting/preempted requests, blocks used, prefix-cache hits, and more."""
    c, b = self.scheduler.counters, self.blocks
    return dict(running=c.running, waiting=c.waiting, preemptions=c.preemptions,
                admitted=c.admitted, finished=c.finished, aborted=c.aborted, steps=c.steps,
                prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
                ragged_decode_steps=self.ragged_steps,
                cached_prompt_tokens=c.cached_prompt_tokens, blocks_used=b.num_used,
                blocks_free=b.num_free, blocks_total=b.num_blocks, blocks_peak=b.peak_used,
                prefix_cache_queries=b.counters.prefix_queries,
                prefix_cache_hits=b.counters.prefix_hits, blocks_evicted=b.counters.evicted)

  # ---- the Engine API ----

  def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None
               ) -> list[Result]:
    """Results in prompt order; an invalid request in a batch gets finish_reason "error"."""
    single, prompts, params = batch_of_requests(prompts, params)
    results: list[Result | None] = [None] * len(prompts)
    valid = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      try:  # every request is checked before any is queued
        valid.append((i, self._request(prompt, p)))
      except ValueError as e:
        if single:
          raise
        results[i] = Result("", [], None, "error", error=str(e))
    ids = {self._queue(request): i for i, request in valid}
    while any(not self.sequences[rid].request.done for rid in ids):
      self.step()
    for rid, i in ids.items():
      results[i] = self.release(rid)
    return results

  def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[Token]:
    """Tokens of one request as they come; other queued requests are served meanwhile."""
    rid = self.add_request(prompt, params)
    queue = self._streams[rid] = collections.deque()

    def forget():
      self._streams.pop(rid, None)
      if rid in self.sequences and self.sequences[rid].request.done:
        del self.sequences[rid]

    def tokens():
      # Whoever runs a step (this stream, another, generate) queues this request's tokens here.
      try:
        while True:
          while queue:
            token = queue.popleft()
            if token.finish_reason is not None:
              forget()  # before the last yield: a caller need not resume us once more
            yield token
            if token.finish_reason is not None:
              return
          self.step()
      finally:
        forget()

    return tokens()

  # ---- one jitted call ----

  def _step_weights(self, t: int):
    """Decode steps (t = 1) read `weights()`, unrolled as Engine's are. Prefill steps scan:
    unrolled, a SmolLM2 prefill shape compiled in 4.7-5.2 s instead of 1.5-1.8 s and ran
    3-20% faster, for one call per admitted prompt."""
    return self.weights() if t == 1 else self.state

  def _run_group(self, group: list[tuple[Sequence, int]], rows: int) -> list[tuple[int, Token]]:
    t = 1 if all(n == 1 for _, n in group) else self._chunk_len(max(n for _, n in group))
    width = _pow2(max(len(s.blocks.blocks) for s, _ in group), 4) if t == 1 else self.max_blocks
    width = min(width, self.max_blocks)
    ragged_step = t == 1 and self.ragged_decode  # a flat list of the pages in use, not tables
    tokens_BT = np.zeros((rows, t), np.int32)
    segment_ids_BT = np.zeros((rows, t), np.int32)
    start_B = np.zeros(rows, np.int32)
    table_BY = np.zeros((rows, width), np.int32)
    step_B = np.zeros(rows, np.int32)
    params = [SamplingParams()] * rows
    penalised = any(s.request.params.repetition_penalty != 1 for s, _ in group)
    seen_BV = np.zeros((rows, self.vocab_size), bool)
    for i, (seq, n) in enumerate(group):
      ids = seq.token_ids
      tokens_BT[i, :n] = ids[seq.num_computed:seq.num_computed + n]
      segment_ids_BT[i, :n] = 1
      start_B[i] = seq.num_computed
      if not ragged_step:
        table_BY[i] = self.blocks.table(seq.blocks, width)
      step_B[i] = len(seq.request.token_ids)
      params[i] = seq.request.params
      if penalised:
        seen_BV[i, ids[:seq.num_computed + n]] = True
    pages, size = table_BY, 0
    if ragged_step:
      ends = [seq.num_computed + n for seq, n in group]
      size = self._ragged_size(ragged.count(ends, self.block_size),
                               self._ragged_cap(rows, width))
      pages = ragged.build([seq.blocks.blocks for seq, _ in group], ends, rows,
                           self.block_size, size)
      width = 0
      self.ragged_steps += 1
    top_n = MAX_TOP_LOGPROBS if any(p.top_logprobs for p in params) else 0
    args = (jnp.asarray(tokens_BT), jnp.asarray(segment_ids_BT), jnp.asarray(start_B),
            jax.tree.map(jnp.asarray, pages), jnp.asarray(seen_BV), RowParams.stack(params),
            jnp.asarray(step_B))
    compiled = self._compiled.get((rows, t, width, size)) if not top_n else None
    weights = self._step_weights(t)
    if compiled is not None:
      token_B, logprob_B, self.pool, top = compiled(weights, self.pool, *args)
    else:
      token_B, logprob_B, self.pool, top = _step(self.graphdef, weights, self.pool, *args,
                                                 top_n=top_n)
    tokens, logprobs = np.asarray(token_B), np.asarray(logprob_B)
    if top is not None:
      top_values, top_ids = np.asarray(top[0]), np.asarray(top[1])
    events = []
    for i, (seq, n) in enumerate(group):
      self.scheduler.computed(seq, n)
      if seq.remaining:
        continue  # mid-prompt: this chunk's sample is not a token of the output
      alternatives = None
      if top is not None and seq.request.params.top_logprobs:
        alternatives = list(zip(top_ids[i].tolist(), top_values[i].tolist()))
      token = seq.request.add(int(tokens[i]), float(logprobs[i]), alternatives)
      if seq.first_token_time is None:
        seq.first_token_time = time.perf_counter()
      events.append((seq.rid, token))
      if seq.request.done:
        self.scheduler.finish(seq)
    return events
