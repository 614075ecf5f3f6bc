"""Sentence embeddings from an encoder model (BERT, sentence-transformers); `embed_file` is
`meshlm embed` (cli/embed.py).

    model, tokenizer = models.load_pretrained(ST_DIR)
    emb_ND = embed(model, tokenizer, ["a sentence", "another"])   # float32, unit rows

An input file is a .txt file (one text per line; blank lines are skipped) or a .jsonl
file whose records hold the text under a key (--text_key).
"""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.loading import load_any

MIN_BUCKET = 16  # shortest padded length: fewer distinct shapes, so fewer compilations


def _bucket(n: int, cap: int) -> int:
  """The next power of two >= n (at least MIN_BUCKET), at most cap."""
  return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), cap)


@functools.partial(jax.jit, static_argnums=0)
def _embed_batch(graphdef, state, tokens_BT, mask_BT):
  return nnx.merge(graphdef, state).embed_sentences(tokens_BT, mask_BT)


def embed(model, tokenizer, texts, batch_size: int = 32, max_len: int | None = None) -> np.ndarray:
  """emb_ND: float32 pooled, L2-normalised embeddings of `texts`, in their order.

  Each text becomes [CLS] text [SEP] (the tokenizer's post-processor), cut to max_len
  tokens (default: tokenizer.max_len, else the model's max_seq_len). Texts are
  batched longest first and padded to a bucketed length; padding is masked out.
  """
  cfg = getattr(model, "cfg", None)
  if cfg is None or cfg.arch != "encoder":
    arch = getattr(cfg, "arch", type(model).__name__)
    raise ValueError(f"embeddings need an encoder model (arch='encoder', e.g. a BERT / "
                     f"sentence-transformers checkpoint); this model has arch={arch!r}")
  if tokenizer is None:
    raise ValueError("embeddings need the model's tokenizer; this checkpoint has none")
  texts = list(texts)
  if not texts:
    raise ValueError("no texts to embed: the input is empty")
  bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
  if bad:
    raise ValueError(f"texts must be strings; item {bad[0]} is {type(texts[bad[0]]).__name__}")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  max_len = max_len or getattr(tokenizer, "max_len", None) or cfg.max_seq_len
  if max_len > cfg.max_seq_len:
    raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
  ids = [tokenizer.encode_special(t, max_len) for t in texts]
  order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
  pad_id = tokenizer.pad_id or 0
  graphdef, state = nnx.split(model)
  emb_ND = np.empty((len(ids), cfg.d_model), np.float32)
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    b = min(batch_size, _bucket(len(rows), batch_size))  # the last batch: fewer padded rows
    t = _bucket(len(ids[rows[0]]), max_len)
    tokens_BT = np.full((b, t), pad_id, np.int32)
    mask_BT = np.zeros((b, t), np.int32)
    for r, i in enumerate(rows):
      tokens_BT[r, :len(ids[i])] = ids[i]
      mask_BT[r, :len(ids[i])] = 1
    emb_BD = _embed_batch(graphdef, state, jnp.asarray(tokens_BT), jnp.asarray(mask_BT))
    emb_ND[rows] = np.asarray(emb_BD)[:len(rows)]
  return emb_ND


def read_texts(path: str, text_key: str = "text") -> list[str]:
  """The texts of a .txt file (one per non-blank line) or a .jsonl file (record[text_key])."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"input file {path} does not exist")
  ext = os.path.splitext(path)[1].lower()
  if ext not in (".txt", ".jsonl"):
    raise ValueError(f"input file {path}: use a .txt (one text per line) or .jsonl file")
  texts = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      if ext == ".txt":
        texts.append(line.rstrip("\r\n"))
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
      text = record.get(text_key) if isinstance(record, dict) else None
      if not isinstance(text, str):
        raise ValueError(f"{path}:{n}: no string field {text_key!r} (set --text_key)")
      texts.append(text)
  if not texts:
    raise ValueError(f"input file {path} has no texts")
  return texts


def write_embeddings(path: str, emb_ND: np.ndarray, texts: list[str]) -> None:
  """.npy: the [N, D] float32 array; .jsonl: {"text", "embedding"} per line. Atomic."""
  tmp = f"{path}.tmp-{os.getpid()}"
  if path.lower().endswith(".npy"):
    with open(tmp, "wb") as f:
      np.save(f, emb_ND)
  else:
    with open(tmp, "w", encoding="utf-8") as f:
      for text, row in zip(texts, emb_ND):
        f.write(json.dumps({"text": text, "embedding": row.tolist()}) + "\n")
  os.replace(tmp, path)


def embed_file(model_path: str, input_path: str, *, text_key: str = "text",
               output: str | None = None, batch_size: int = 32,
               max_len: int | None = None) -> dict:
  """Embeds the texts of `input_path` (read_texts) with the model at `model_path`, writes them
  to `output` (.npy or .jsonl) if given, and returns a summary."""
  if output is not None and os.path.splitext(output)[1].lower() not in (".npy", ".jsonl"):
    raise ValueError(f"--output {output}: use a .npy or .jsonl file")
  texts = read_texts(input_path, text_key)  # fails before the (slow) load
  model, tokenizer = load_any(model_path)
  start = time.perf_counter()
  emb_ND = embed(model, tokenizer, texts, batch_size=batch_size, max_len=max_len)
  seconds = time.perf_counter() - start
  if output is not None:
    write_embeddings(output, emb_ND, texts)
  return dict(model=model_path, input=input_path, texts=len(texts), dim=int(emb_ND.shape[1]),
              output=output, seconds=round(seconds, 3),
              texts_per_second=round(len(texts) / seconds, 1))
