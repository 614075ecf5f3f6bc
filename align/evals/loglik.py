"""log p(continuation | context) under a meshlm decoder, as lm-evaluation-harness computes it.

Tokenization follows the harness's `_encode_pair`: trailing whitespace of the context moves
to the continuation, the whole string and the context are encoded separately, and the
continuation's tokens are the whole string's tokens past len(encode(context)). The model
reads encode(context) + those tokens (BOS only where `tokenizer.encode` adds one by default:
SmolLM2 adds none, as the harness's add_special_tokens=False does not). An empty context is
replaced by the BOS (or EOS) token, as the harness's prefix token.

Evaluation prompts share long few-shot primers, so the tokens every request starts with are
run once into a KV cache (infer/kv_cache.py); each batch of requests broadcasts that cache
and runs only its own tail as one chunk. The result equals a full forward up to float32
summation order. Chunks are right-padded to a multiple of 32 tokens and batches to
`batch_size` rows, so a handful of shapes compile; log_softmax is taken in float32.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from infer import kv_cache

CHUNK_MULTIPLE = 32  # chunk lengths round up to this: few compiled shapes, little padding


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids) exactly as the harness splits them."""
  n_spaces = len(context) - len(context.rstrip())
  if n_spaces:
    context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
  if not context:
    prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if prefix is None:
      raise ValueError("an empty context needs a BOS or EOS token to condition on; the "
                       "tokenizer has neither")
    return [prefix], tokenizer.encode(continuation)
  whole = tokenizer.encode(context + continuation)
  ctx = tokenizer.encode(context)
  return ctx, whole[len(ctx):]


def _common_prefix(seqs: list[list[int]]) -> int:
  first = seqs[0]
  n = min(len(s) for s in seqs)
  for s in seqs[1:]:
    i = 0
    while i < n and s[i] == first[i]:
      i += 1
    n = i
  return n


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill(graphdef, state, tokens_1P, *, max_len):
  """A one-row cache of `max_len` slots holding the shared prefix tokens_1P."""
  model = nnx.merge(graphdef, state)
  cache = kv_cache.init(model.cfg, 1, max_len)
  if tokens_1P.shape[1] == 0:
    return cache
  _, cache = kv_cache.forward(model, tokens_1P, jnp.ones_like(tokens_1P), cache)
  return cache


def _broadcast(cache_1: kv_cache.KVCache, rows: int) -> kv_cache.KVCache:
  """The one-row cache repeated to `rows` rows (k, v and their scales carry layers first)."""
  layered = ("k_LBSKH", "v_LBSKH", "k_scale_LBSK", "v_scale_LBSK")
  out = {}
  for name, a in cache_1._asdict().items():
    if a is not None:
      axis = 1 if name in layered else 0
      a = jnp.broadcast_to(a, a.shape[:axis] + (rows,) + a.shape[axis + 1:])
    out[name] = a
  return kv_cache.KVCache(**out)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, cache_1, tokens_BT, segment_ids_BT, targets_BT, mask_BT):
  """(sum of masked target log-probs, all masked targets greedy) per row, the chunk tokens_BT
  appended to the shared one-row cache."""
  model = nnx.merge(graphdef, state)
  cache = _broadcast(cache_1, tokens_BT.shape[0])
  logits_BTV, _ = kv_cache.forward(model, tokens_BT, segment_ids_BT, cache, all_logits=True)
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  tok_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  greedy_BT = jnp.argmax(logp_BTV, axis=-1) == targets_BT
  keep_BT = mask_BT > 0
  return (jnp.sum(jnp.where(keep_BT, tok_BT, 0.0), axis=-1),
          jnp.all(greedy_BT | ~keep_BT, axis=-1))


def continuation_logliks(model, tokenizer, pairs, batch_size: int = 16, *,
                         return_details: bool = False, progress=None):
  """logliks_N float64: sum of log p(continuation tokens | context) for each (context,
  continuation). With return_details, (logliks_N, token counts n_N, is_greedy_N).
  `progress(done, total)` is called after each batch (unique requests)."""
  if model.cfg.arch != "decoder":
    raise ValueError(f"continuation_logliks needs a causal decoder; got arch={model.cfg.arch!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  unique = list(dict.fromkeys((c, x) for c, x in pairs))  # harness requests repeat (MC1 in MC2)
  if not unique:
    empty = np.zeros((0,), np.float64)
    return (empty, np.zeros((0,), np.int64), np.zeros((0,), bool)) if return_details else empty
  limit = model.cfg.max_seq_len
  fulls, starts = [], []
  for context, continuation in unique:
    ctx, cont = encode_pair(tokenizer, context, continuation)
    if not cont:
      raise ValueError(f"continuation {continuation!r} encodes to no tokens after context "
                       f"{context[-40:]!r}")
    if len(cont) > limit:
      raise ValueError(f"continuation of {len(cont)} tokens exceeds max_seq_len={limit}")
    full = (ctx + cont)[-(limit + 1):]  # the harness keeps the last max_length + 1 tokens
    fulls.append(full)
    starts.append(len(full) - len(cont) - 1)  # the input position that predicts cont[0]
  seqs = [f[:-1] for f in fulls]  # model inputs; position t predicts f[t + 1]
  # Every target must be predicted inside a row's own chunk, so the shared prefix stops
  # before the first predicting position.
  prefix = min(_common_prefix(seqs), min(starts))
  tails = [len(s) - prefix for s in seqs]
  chunk_max = -(-max(tails) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
  max_len = prefix + chunk_max
  graphdef, state = nnx.split(model)
  with jax.default_matmul_precision("highest"):  # no TF32/bf16 passes on accelerators
    cache_1 = _prefill(graphdef, state, jnp.asarray([seqs[0][:prefix]], jnp.int32),
                       max_len=max_len)
    ll_N = np.zeros((len(seqs),), np.float64)
    greedy_N = np.zeros((len(seqs),), bool)
    order = sorted(range(len(seqs)), key=lambda i: (tails[i], i))  # similar lengths together
    for at in tqdm.tqdm(range(0, len(order), batch_size), desc="log-likelihoods", unit="batch",
                        leave=False, disable=None):
      rows = order[at:at + batch_size]
      t = -(-max(tails[i] for i in rows) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
      tokens = np.zeros((batch_size, t), np.int32)
      segs, targets, mask = (np.zeros((batch_size, t), np.int32) for _ in range(3))
      for b, i in enumerate(rows):
        tokens[b, :tails[i]] = seqs[i][prefix:]
        segs[b, :tails[i]] = 1
        targets[b, :tails[i]] = fulls[i][prefix + 1:]
        mask[b, starts[i] - prefix:tails[i]] = 1
      ll_B, greedy_B = _score(graphdef, state, cache_1, tokens, segs, targets, mask)
      ll_N[rows] = np.asarray(ll_B, np.float64)[:len(rows)]
      greedy_N[rows] = np.asarray(greedy_B)[:len(rows)]
      if progress is not None:
        progress(at + len(rows), len(order))
  index = {p: i for i, p in enumerate(unique)}
  pick = [index[(c, x)] for c, x in pairs]
  if not return_details:
    return ll_N[pick]
  n_N = np.array([len(s) - st for s, st in zip(seqs, starts)], np.int64)  # = len(cont)
  return ll_N[pick], n_N[pick], greedy_N[pick]

