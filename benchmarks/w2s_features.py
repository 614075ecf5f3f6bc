"""Frozen-backbone features of hh-rlhf final exchanges for the weak-to-strong reproduction.

A pair's two transcripts are cut to their final exchange (the last human turn and the
assistant's reply); each side is one text "Human: {prompt}\\n\\nAssistant: {response}".

  encoder_features  sentence embeddings (infer.embed: mean pooled, unit rows) of an encoder
                    (weak: all-MiniLM-L6-v2); {"embed": [N, D]}
  decoder_features  hidden states of a decoder (strong: SmolLM2-135M-Instruct) pooled two
                    ways at two depths: {"mid_mean", "mid_last", "final_mean", "final_last"},
                    [N, D] each; mean = over the response tokens, last = the last token;
                    mid = after layer num_layers // 2, final = after the final norm
  bow_features      hashed bag of words of the reply (weak: a ~4k-parameter linear model);
                    {"bow": [N, buckets]}, numpy only, no model, no cache
  cached_features   encoder or decoder features, computed once per (model, texts, settings)
                    and kept as .npz
"""

import hashlib
import json
import os
import re
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.blocks import run_stack
from models.positions import default_positions

BUCKET = 32  # padded lengths are multiples of this: few shapes to compile


def exchange_text(prompt: str, response: str) -> str:
  return f"Human: {prompt}\n\nAssistant: {response}"


def decoder_ids(tokenizer, prompt: str, response: str, max_prompt: int, max_len: int):
  """(ids, n_prompt): the human turn cut to max_prompt tokens, the reply cut so that the
  whole is at most max_len tokens; n_prompt tokens precede the reply."""
  head = tokenizer.encode(f"Human: {prompt}", add_bos=False)[:max_prompt]
  head = head + tokenizer.encode("\n\nAssistant:", add_bos=False)
  reply = tokenizer.encode(f" {response}", add_bos=False)
  if len(head) >= max_len:
    raise ValueError(f"max_len={max_len} leaves no room for the reply after max_prompt="
                     f"{max_prompt}")
  reply = reply[:max_len - len(head)] or [tokenizer.eos_id]  # an empty reply: read at EOS
  return head + reply, len(head)


def _make_forward(model, split: int, final: bool):
  """A jitted (tokens_BT, resp_BT, last_B) -> pooled [B, D] arrays of `model` (mid_* and,
  with `final`, final_*: without, the layers after `split` are never run)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens_BT, resp_BT, last_B):
    m = nnx.merge(graphdef, state)
    cfg = m.cfg
    positions_BT = default_positions(tokens_BT)
    x_BTD = m.embed(tokens_BT, positions_BT)
    # The stacked blocks (leading layer axis) cut in two: the middle state is read on the way.
    block_def, block_state = nnx.split(m.blocks)
    halves = [nnx.merge(block_def, jax.tree.map(lambda a: a[sl], block_state))
              for sl in (slice(0, split), slice(split, None))]
    mid_BTD, _ = run_stack(halves[0], cfg, x_BTD, positions_BT, None, bias_fn=m.bias_fn())
    states = [("mid", mid_BTD)]
    if final:
      x_BTD, _ = run_stack(halves[1], cfg, mid_BTD, positions_BT, None, bias_fn=m.bias_fn(),
                           first_layer=split)
      states.append(("final", m.final_hidden(x_BTD)))
    w_BT = resp_BT / jnp.maximum(resp_BT.sum(1, keepdims=True), 1.0)
    out = {}
    for name, h_BTD in states:
      h_BTD = h_BTD.astype(jnp.float32)
      out[f"{name}_mean"] = jnp.einsum("BT,BTD->BD", w_BT, h_BTD)
      out[f"{name}_last"] = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]
    return out

  return lambda *a: forward(state, *a)


def decoder_features(model, tokenizer, prompts, responses, *, max_prompt: int = 48,
                     max_len: int = 160, batch_size: int = 16, final: bool = True,
                     log=None) -> dict:
  """{"mid_mean", "mid_last", "final_mean", "final_last"}: float32 [N, D] (module doc);
  final=False reads the middle layer only, for half the cost."""
  cfg = getattr(model, "cfg", None)
  if cfg is None or cfg.arch != "decoder" or not hasattr(model, "blocks"):
    raise ValueError(f"decoder_features needs a decoder model; got {type(model).__name__}")
  if not cfg.scan_layers or cfg.num_layers < 2:
    raise ValueError("decoder_features reads the middle layer of stacked (scan_layers) blocks")
  if len(prompts) != len(responses) or not prompts:
    raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: need equal, > 0")
  enc = [decoder_ids(tokenizer, p, r, max_prompt, max_len) for p, r in zip(prompts, responses)]
  order = sorted(range(len(enc)), key=lambda i: -len(enc[i][0]))
  forward = _make_forward(model, cfg.num_layers // 2, final)
  out = {f"{depth}_{pool}": np.empty((len(enc), cfg.d_model), np.float32)
         for depth in (("mid", "final") if final else ("mid",)) for pool in ("mean", "last")}
  pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
  start_time = time.perf_counter()
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    t = -(-len(enc[rows[0]][0]) // BUCKET) * BUCKET
    tokens_BT = np.full((batch_size, t), pad, np.int32)  # right padding: causal, never read
    resp_BT = np.zeros((batch_size, t), np.float32)
    last_B = np.zeros((batch_size,), np.int32)
    for r, i in enumerate(rows):
      ids, n_prompt = enc[i]
      tokens_BT[r, :len(ids)] = ids
      resp_BT[r, n_prompt:len(ids)] = 1.0
      last_B[r] = len(ids) - 1
    got = forward(jnp.asarray(tokens_BT), jnp.asarray(resp_BT), jnp.asarray(last_B))
    for k, v in got.items():
      out[k][rows] = np.asarray(v)[:len(rows)]
    if log and (start // batch_size) % 20 == 0:
      log(f"decoder features: {start + len(rows)}/{len(order)} texts, "
          f"{time.perf_counter() - start_time:.0f} s")
  return out


def encoder_features(model, tokenizer, prompts, responses, *, max_len: int = 160,
                     batch_size: int = 32, log=None) -> dict:
  """{"embed": [N, D]}: infer.embed of each exchange_text, cut to max_len tokens."""
  from infer.embed import embed
  if len(prompts) != len(responses) or not prompts:
    raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: need equal, > 0")
  texts = [exchange_text(p, r) for p, r in zip(prompts, responses)]
  start_time = time.perf_counter()
  emb_ND = embed(model, tokenizer, texts, batch_size=batch_size, max_len=max_len)
  if log:
    log(f"encoder features: {len(texts)} texts, {time.perf_counter() - start_time:.0f} s")
  return {"embed": emb_ND}


_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def bow_terms(text: str) -> list[str]:
  """Unigrams and bigrams of the normalized text (lower case, runs of letters and digits,
  an apostrophe kept inside a word: "don't")."""
  words = _WORD.findall(text.lower())
  return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


def bow_bucket(term: str, buckets: int) -> int:
  """The term's bucket: CRC-32 of its UTF-8 bytes, stable across runs and machines (unlike
  Python's salted hash)."""
  return zlib.crc32(term.encode("utf-8")) % buckets


def bow_features(prompts, responses, *, buckets: int = 4096) -> dict:
  """{"bow": float32 [N, buckets]}: log1p of the hashed unigram + bigram counts of each
  reply. The prompt is left out on purpose: under a linear Bradley-Terry head both sides of a
  pair share it, so its terms cancel in s(A) - s(B)."""
  if len(prompts) != len(responses) or not prompts:
    raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: need equal, > 0")
  if buckets < 2:
    raise ValueError(f"buckets={buckets} must be >= 2")
  counts_NV = np.zeros((len(responses), buckets), np.float32)
  for i, response in enumerate(responses):
    for term in bow_terms(response):
      counts_NV[i, bow_bucket(term, buckets)] += 1.0
  return {"bow": np.log1p(counts_NV)}


def cache_key(model_path: str, kind: str, prompts, responses, settings: dict) -> str:
  """A digest of everything the features depend on."""
  h = hashlib.sha256(json.dumps([os.path.abspath(model_path), kind, settings],
                                sort_keys=True).encode())
  for p, r in zip(prompts, responses):
    h.update(p.encode("utf-8") + b"\0" + r.encode("utf-8") + b"\1")
  return h.hexdigest()[:16]


def cached_features(cache_dir: str, model_path: str, kind: str, prompts, responses,
                    settings: dict, log=None, loaded=None) -> tuple[dict, bool]:
  """(features, was_cached): loads CACHE_DIR/{kind}-{key}.npz, else loads the model (an
  "encoder" or a "decoder" checkpoint; `loaded`: its (model, tokenizer) already in memory),
  extracts and saves atomically."""
  if kind not in ("encoder", "decoder"):
    raise ValueError(f"kind={kind!r}; choose 'encoder' or 'decoder'")
  key = cache_key(model_path, kind, prompts, responses, settings)
  path = os.path.join(cache_dir, f"{kind}-{key}.npz")
  if os.path.exists(path):
    with np.load(path) as z:
      return {k: z[k] for k in z.files}, True
  if loaded is None:
    from models import load_pretrained
    loaded = load_pretrained(model_path)
  model, tokenizer = loaded
  fn = encoder_features if kind == "encoder" else decoder_features
  feats = fn(model, tokenizer, prompts, responses, log=log, **settings)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}.npz"
  np.savez(tmp, **feats)
  os.replace(tmp, path)
  return feats, False
