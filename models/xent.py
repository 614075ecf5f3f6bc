"""The unembedding and its cross-entropy fused over chunks of rows.

A language model's loss needs, per token, only the log-sum-exp of its logits
and the logit of its target; its gradient needs softmax - onehot. `xent_sum`
computes both a chunk of rows at a time, so the [M, V] float32 logits (the
step's largest activation: 64 MiB for the reference CPU config, 384 MiB at
SmolLM2's vocabulary) and their gradient never exist whole. The forward pass
of a gradient computes the backward's products in the same pass over a
chunk: dx = g·Wᵀ and dW += xᵀ·g with g = (softmax - onehot)·weight; the
backward pass only scales them. Every matmul is a plain 2-D one (xᵀ
materialised, as in models/matmul.py). On a CPU this saves memory, not time
(docs/results.md, "Training"). Summation order differs from the
unfused loss only within float32 rounding (tests/test_xent.py).
"""

import functools
import math

import jax
import jax.numpy as jnp

# Rows per chunk: XLA:CPU's matmuls lose speed below ~512 rows
# (docs/notes/cpu_training_throughput.md); at vocabulary 8192 that is 16 MiB of float32 logits.
CHUNK_ROWS = 512


def chunk_rows(m: int, most: int | None = None) -> int:
  """Rows per chunk: at most `most` (default CHUNK_ROWS), spread evenly over the chunks,
  so padding adds fewer rows than there are chunks."""
  most = max(1, min(m, most or CHUNK_ROWS))
  chunks = math.ceil(m / most)
  return math.ceil(m / chunks)


def xent_sum(x_MD, w, targets_M, weights_M, *, vocab_major: bool, dtype,
             rows: int | None = None) -> jax.Array:
  """sum_m weights_M[m] * CE(x_MD[m] · W, targets_M[m]), in float32.

  w is the table as stored: [V, D] with vocab_major (tied embeddings), else [D, V];
  the matmuls run in `dtype` with float32 accumulation, like models/layers.project
  with preferred_element_type=float32. weights_M gets no gradient (it is a mask).
  """
  rows = rows or chunk_rows(x_MD.shape[0])
  return _xent(vocab_major, jnp.dtype(dtype), rows, x_MD, w, targets_M,
               weights_M.astype(jnp.float32))


def _chunks(rows, x_MD, targets_M, weights_M):
  """[n, rows, ...] chunks; padded rows weigh 0."""
  m = x_MD.shape[0]
  pad = -m % rows
  if pad:
    x_MD = jnp.pad(x_MD, ((0, pad), (0, 0)))
    targets_M = jnp.pad(targets_M, (0, pad))
    weights_M = jnp.pad(weights_M, (0, pad))
  n = (m + pad) // rows
  return (x_MD.reshape(n, rows, -1), targets_M.reshape(n, rows), weights_M.reshape(n, rows))


def _tables(vocab_major, dtype, w, both=True):
  """W as [D, V] (for x·W) and, with `both`, as [V, D] (for g·Wᵀ), materialised in `dtype`."""
  w = w.astype(dtype)
  w_VD, w_DV = (w, w.T) if vocab_major else (w.T, w)
  return jax.lax.optimization_barrier((w_DV, w_VD) if both else (w_DV, None))


def _chunk_loss(x_RD, w_DV, targets_R, weights_R):
  """Per-row logits (float32), log-sum-exp and weighted loss of one chunk."""
  logits_RV = jnp.matmul(x_RD, w_DV, preferred_element_type=jnp.float32)
  lse_R = jax.nn.logsumexp(logits_RV, axis=-1)
  target_R = jnp.take_along_axis(logits_RV, targets_R[:, None], axis=-1)[:, 0]
  return logits_RV, lse_R, jnp.sum((lse_R - target_R) * weights_R)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _xent(vocab_major, dtype, rows, x_MD, w, targets_M, weights_M):
  w_DV, _ = _tables(vocab_major, dtype, w, both=False)  # the loss alone needs no Wᵀ
  xs = _chunks(rows, x_MD.astype(dtype), targets_M, weights_M)

  def body(total, chunk):
    return total + _chunk_loss(chunk[0], w_DV, *chunk[1:])[2], None

  return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


def _xent_fwd(vocab_major, dtype, rows, x_MD, w, targets_M, weights_M):
  w_DV, w_VD = _tables(vocab_major, dtype, w)
  xs = _chunks(rows, x_MD.astype(dtype), targets_M, weights_M)

  def body(carry, chunk):
    total, dw_DV = carry
    x_RD, targets_R, weights_R = chunk
    logits_RV, lse_R, loss = _chunk_loss(x_RD, w_DV, targets_R, weights_R)
    onehot_RV = jax.nn.one_hot(targets_R, logits_RV.shape[-1], dtype=jnp.float32)
    g_RV = (jnp.exp(logits_RV - lse_R[:, None]) - onehot_RV) * weights_R[:, None]
    g_RV = g_RV.astype(dtype)
    dx_RD = jnp.matmul(g_RV, w_VD, preferred_element_type=jnp.float32)
    x_DR = jax.lax.optimization_barrier(x_RD.T)
    dw_DV = dw_DV + jnp.matmul(x_DR, g_RV, preferred_element_type=jnp.float32)
    return (total + loss, dw_DV), dx_RD

  zeros_DV = jnp.zeros(w_DV.shape, jnp.float32)
  (total, dw_DV), dx_nRD = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros_DV), xs)
  dx_MD = dx_nRD.reshape(-1, dx_nRD.shape[-1])[:x_MD.shape[0]].astype(x_MD.dtype)
  dw = (dw_DV.T if vocab_major else dw_DV).astype(w.dtype)
  return total, (dx_MD, dw)


def _xent_bwd(vocab_major, dtype, rows, res, g):
  dx_MD, dw = res
  return (g * dx_MD).astype(dx_MD.dtype), (g * dw).astype(dw.dtype), None, None


_xent.defvjp(_xent_fwd, _xent_bwd)
