"""Encoder-decoder (T5) generation: encode the sources once, decode with the KV cache.

    engine = Seq2SeqEngine(model, tokenizer, max_seq_len=128, max_batch=8)
    results = engine.generate(["translate English to German: Hi"], SamplingParams(max_tokens=32))

A batch of up to `max_batch` sources is right-padded (length bucketed by
kv_cache.bucket; encoder segment ids 0 on the padding, which no query ever attends) and
encoded once, and every decoder layer's cross-attention keys and values of it
are computed then too (`EncoderDecoder.cross_kv`), not once per token. The decoder then starts every row from the decoder start token
(`cfg.bos_id`; T5: pad, 0) and runs one jitted step per token over the
contiguous KV cache of infer/kv_cache.py, exactly as infer/engine.py decodes a
decoder-only model: `EncoderView` binds those keys and values to
`model.decode`, so `kv_cache.forward` drives it unchanged. Sampling, stop
conditions and results are the engine's (infer/sampling.py, infer/requests.py).
A row's tokens do not depend on its batch-mates; finished rows ride along masked.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import kv_cache
from infer.engine import Engine
from infer.requests import Request
from infer.sampling import RowParams, SamplingParams, mark_seen, sample


class EncoderView:
  """The model as kv_cache.forward sees it: `.cfg`, and a `.decode` that cross-attends to one
  batch's encoder keys and values enc_kv = model.cross_kv(enc_BSD) (padding:
  enc_segment_ids_BS == 0)."""

  def __init__(self, model, enc_kv, enc_segment_ids_BS):
    self.model, self.cfg = model, model.cfg
    self.enc_kv, self.enc_segment_ids_BS = enc_kv, enc_segment_ids_BS

  def decode(self, tokens_BT, positions_BT, segment_ids_BT, layers_cache, cache, last_B=None):
    return self.model.decode(tokens_BT, positions_BT, segment_ids_BT, layers_cache, cache,
                             last_B, enc_kv=self.enc_kv,
                             enc_segment_ids_BS=self.enc_segment_ids_BS)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "kv_dtype"))
def _start(graphdef, state, src_BS, src_segment_ids_BS, rows, *, max_len, kv_dtype=None):
  """Encodes the sources and decodes the start token: (token_B, logprob_B, cache, enc_kv,
  seen_BV). The start token counts as seen, as in HF's repetition penalty."""
  model = nnx.merge(graphdef, state)
  b = src_BS.shape[0]
  enc_kv = model.cross_kv(model.encode(src_BS, None, src_segment_ids_BS))
  view = EncoderView(model, enc_kv, src_segment_ids_BS)
  start_B1 = jnp.full((b, 1), model.cfg.bos_id, jnp.int32)
  real_B1 = (src_segment_ids_BS[:, :1] > 0)  # rows padding the batch have no source
  cache = kv_cache.init(model.cfg, b, max_len, kv_dtype)
  logits_BV, cache = kv_cache.forward(view, start_B1, real_B1.astype(jnp.int32), cache)
  seen_BV = mark_seen(jnp.zeros(logits_BV.shape, bool), start_B1, real_B1)
  token_B, logprob_B = sample(logits_BV, seen_BV, rows, jnp.zeros((b,), jnp.int32))
  return token_B, logprob_B, cache, enc_kv, mark_seen(seen_BV, token_B[:, None], real_B1)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache", "seen_BV"))
def _step(graphdef, state, cache, enc_kv, enc_segment_ids_BS, token_B, active_B, seen_BV, rows,
          step):
  """One decoder token for every row (one step of engine._decode, the encoder's keys bound)."""
  view = EncoderView(nnx.merge(graphdef, state), enc_kv, enc_segment_ids_BS)
  logits_BV, cache = kv_cache.forward(view, token_B[:, None], active_B[:, None].astype(jnp.int32),
                                      cache)
  token_B, logprob_B = sample(logits_BV, seen_BV, rows, jnp.full(token_B.shape, step, jnp.int32))
  return token_B, logprob_B, cache, mark_seen(seen_BV, token_B[:, None], active_B[:, None])


class _IdsOnly:
  """Stands in for a tokenizer when there is none: results carry token ids, text is ""."""

  @staticmethod
  def decode(ids):
    return ""


class Seq2SeqEngine(Engine):
  """KV-cached generation for an EncoderDecoder; see the module docstring. `generate` and
  `stream` are the Engine's; only requests and the jitted steps differ.

  max_seq_len: decoder cache slots per row (default the model's max_seq_len; max_tokens
  may not exceed it);
  max_source_len: longest source (default max_seq_len). Text sources need a
  tokenizer and get no BOS; with `append_eos` (T5) they end with its EOS, as HF's
  T5 tokenizer does. Models trained on train/seq2seq_data.py saw sources without
  EOS: serve them with append_eos=False.
  """

  def __init__(self, model, tokenizer=None, max_seq_len: int | None = None, max_batch: int = 8, *,
               max_source_len: int | None = None, kv_dtype: str | None = None,
               append_eos: bool = True):
    cfg = model.cfg  # Engine.__init__ is not called: it sizes a decoder-only cache
    if cfg.arch != "encoder_decoder":
      raise ValueError(f"Seq2SeqEngine serves arch='encoder_decoder' models, not {cfg.arch!r} "
                       "(use infer.Engine)")
    if cfg.bos_id is None:
      raise ValueError("model.cfg.bos_id (the decoder start token; T5: pad, 0) is not set")
    kv_cache.check_kv_dtype(kv_dtype)
    max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
    max_source_len = max_seq_len if max_source_len is None else max_source_len
    for name, value in (("max_seq_len", max_seq_len), ("max_source_len", max_source_len),
                        ("max_batch", max_batch)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Seq2SeqEngine {name}={value!r} must be a positive integer")
      if name != "max_batch" and cfg.position == "learned" and value > cfg.max_seq_len:
        raise ValueError(f"Seq2SeqEngine {name}={value} exceeds the model's learned position "
                         f"table (max_seq_len={cfg.max_seq_len})")
    self.tokenizer, self.append_eos = tokenizer, append_eos
    tokenizer_eos = None if tokenizer is None else tokenizer.eos_id
    self.eos_id = cfg.eos_id if tokenizer_eos is None else tokenizer_eos
    self.vocab_size = cfg.vocab_size
    self.max_seq_len, self.max_source_len, self.max_batch = max_seq_len, max_source_len, max_batch
    self.kv_dtype = kv_dtype
    self.graphdef, self.state = nnx.split(model)
    self.unroll_layers = False  # its steps scan (infer/engine.py unrolls decoders only)

  def _request(self, source, params: SamplingParams) -> Request:
    if isinstance(source, str):
      if self.tokenizer is None:
        raise ValueError("a text source needs a tokenizer; pass token ids or a tokenizer")
      ids = self.tokenizer.encode(source, add_bos=False)
      if self.append_eos and self.eos_id is not None and ids[-1:] != [self.eos_id]:
        ids.append(self.eos_id)
    else:
      ids = [int(t) for t in source]
    params.validate()
    if not ids:
      raise ValueError("empty source: a request needs at least one source token")
    if len(ids) > self.max_source_len:
      raise ValueError(f"source of {len(ids)} tokens exceeds max_source_len="
                       f"{self.max_source_len}")
    if params.max_tokens > self.max_seq_len:
      raise ValueError(f"max_tokens={params.max_tokens} exceeds the decoder's max_seq_len="
                       f"{self.max_seq_len}")
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f"source token id {bad[0]} is outside the vocabulary [0, "
                       f"{self.vocab_size})")
    if params.stop and self.tokenizer is None:
      raise ValueError("stop strings need a tokenizer (use stop_token_ids)")
    return Request(ids, params, self.eos_id, self.tokenizer or _IdsOnly())

  def _run(self, requests: list[Request], per_token: bool = False):
    """Serves a batch (<= max_batch) to completion, yielding each step's new tokens (one step
    per jitted call, whatever `per_token` says)."""
    n = len(requests)
    b, src_BS, src_segment_ids_BS = self._padded(requests, self.max_source_len)
    src_segment_ids_BS = jnp.asarray(src_segment_ids_BS)
    rows = RowParams.stack([r.params for r in requests] + [SamplingParams()] * (b - n))
    token_B, logprob_B, cache, enc_kv, seen_BV = _start(
        self.graphdef, self.state, jnp.asarray(src_BS), src_segment_ids_BS, rows,
        max_len=self.max_seq_len, kv_dtype=self.kv_dtype)
    carry = {"cache": cache, "seen": seen_BV}

    def advance(token_B, active_B, step):
      token_B, logprob_B, carry["cache"], carry["seen"] = _step(
          self.graphdef, self.state, carry["cache"], enc_kv, src_segment_ids_BS, token_B,
          active_B, carry["seen"], rows, step)
      return np.asarray(token_B)[None], np.asarray(logprob_B)[None]

    yield from self._host_loop(requests, b, token_B, logprob_B, advance)
