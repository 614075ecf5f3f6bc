"""The unembedding and its cross-entropy fused over chunks of positions.

A language model's loss needs, per token, only the log-sum-exp of its logits
and the logit of its target; its gradient needs softmax - onehot. `xent_sum`
computes both a chunk of positions at a time, so the [B, T, V] float32 logits (the
step's largest activation: 64 MiB for the reference CPU config, 384 MiB at
SmolLM2's vocabulary, 4 GiB per device for llama3_8b_pod) and their gradient never
exist whole. The forward pass of a gradient computes the backward's products in the
same pass over a chunk: dx = g·Wᵀ and dW += xᵀ·g with g = (softmax - onehot)·weight;
the backward pass only scales them. On a CPU this saves memory, not time
(docs/results.md, "Training"). Summation order differs from the unfused loss only
within float32 rounding (tests/test_xent.py).

Chunks are strided: chunk j holds positions j, j + n, j + 2n, … of every row, so a
device whose rows (batch) and positions (a contiguous block under sequence
parallelism) are its own keeps them in every chunk, and the loop runs over a
dimension no mesh axis splits. Contiguous chunks of the flattened rows would put the
loop on the sharded dimension, where XLA's partitioner reshards the hidden states
over the model dimension and all-reduces every chunk's logits instead. The output
table is gathered (FSDP) once, outside the loop, with the vocabulary split as the
logits' is (`act_vocab`).
"""

import functools
import math

import jax
import jax.numpy as jnp

from parallel import constrain, shards_of

# Rows per chunk and device: XLA:CPU's matmuls lose speed below ~512 rows
# (docs/notes/cpu_training_throughput.md); at vocabulary 8192 that is 16 MiB of float32 logits.
CHUNK_ROWS = 512
_X = ("act_batch", "act_seq", "act_embed")
_LOGITS = ("act_batch", "act_seq", "act_vocab")


def num_chunks(rows: int, seq: int, most: int | None = None) -> int:
  """Chunks for a device that holds `rows` rows of `seq` positions each: the fewest that
  divide `seq` and leave at most `most` (default CHUNK_ROWS) rows·positions a chunk, else
  one per position."""
  most = most or CHUNK_ROWS
  for n in range(1, seq + 1):
    if seq % n == 0 and rows * seq <= most * n:
      return n
  return seq


def xent_sum(x_BTD, w, targets_BT, weights_BT, *, vocab_major: bool, dtype,
             chunks: int | None = None, unroll: bool = False) -> jax.Array:
  """sum_bt weights_BT[b, t] * CE(x_BTD[b, t] · W, targets_BT[b, t]), in float32.

  w is the table as stored: [V, D] with vocab_major (tied embeddings), else [D, V];
  the matmuls run in `dtype` with float32 accumulation, like models/layers.project
  with preferred_element_type=float32; the table's gradient sums the chunks in `dtype` (a
  float32 sum would hold 2 GiB more for llama3_8b_pod; in bfloat16 it rounds once per chunk
  where whole logits round once). weights_BT gets no gradient (it is a mask).
  `chunks` must divide T (default: `num_chunks` of one device's share); `unroll` unrolls
  their loop (compile probes do, so that a cost model counts every chunk).
  """
  b, t, _ = x_BTD.shape
  if chunks is None:
    seq_shards = shards_of("act_seq")
    local_t = t // seq_shards if t % seq_shards == 0 else t
    chunks = num_chunks(math.ceil(b / shards_of("act_batch")), local_t)
  if t % chunks:
    raise ValueError(f"{chunks} loss chunks do not divide the sequence length {t}")
  # Cast outside the custom VJP: its gradient is the table's in `dtype`, converted to the
  # stored dtype by JAX after the gradient's reduction over the batch shards, as for any matmul.
  return _xent(vocab_major, chunks, bool(unroll), x_BTD.astype(dtype), w.astype(dtype),
               targets_BT, weights_BT.astype(jnp.float32))


def _strided(n, *arrays_BT):
  """Each [B, T, ...] array as [n, B, T/n, ...]: chunk j holds positions j, j + n, …"""
  out = []
  for a in arrays_BT:
    b, t = a.shape[:2]
    out.append(jnp.moveaxis(a.reshape(b, t // n, n, *a.shape[2:]), 2, 0))
  return tuple(out)


def _table(vocab_major, w):
  """W as [D, V], gathered over all but the vocabulary's split: once for every chunk (the
  backward's g·Wᵀ contracts the same table over V)."""
  w_DV = constrain(w.T if vocab_major else w, (None, "act_vocab"))
  return jax.lax.optimization_barrier(w_DV)


def _chunk_loss(x_BCD, w_DV, targets_BC, weights_BC):
  """Per-position logits (float32), log-sum-exp and weighted loss of one chunk."""
  x_BCD = constrain(x_BCD, _X)
  logits_BCV = constrain(jnp.einsum("BCD,DV->BCV", x_BCD, w_DV,
                                    preferred_element_type=jnp.float32), _LOGITS)
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  if shards_of("act_vocab") == 1:
    target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
  else:  # a gather over a split vocabulary all-gathers the logits (train/step.token_losses)
    vocab_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
    target_BC = jnp.sum(jnp.where(vocab_BCV == targets_BC[..., None], logits_BCV, 0.0), -1)
  return logits_BCV, lse_BC, jnp.sum((lse_BC - target_BC) * weights_BC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _xent(vocab_major, n, unroll, x_BTD, w, targets_BT, weights_BT):
  w_DV = _table(vocab_major, w)
  xs = _strided(n, x_BTD, targets_BT, weights_BT)

  def body(total, chunk):
    return total + _chunk_loss(chunk[0], w_DV, *chunk[1:])[2], None

  return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs, unroll=unroll)[0]


def _xent_fwd(vocab_major, n, unroll, x_BTD, w, targets_BT, weights_BT):
  w_DV = _table(vocab_major, w)
  xs = _strided(n, x_BTD, targets_BT, weights_BT)

  def body(carry, chunk):
    total, dw_DV = carry
    x_BCD, targets_BC, weights_BC = chunk
    logits_BCV, lse_BC, loss = _chunk_loss(x_BCD, w_DV, targets_BC, weights_BC)
    vocab_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
    onehot_BCV = (vocab_BCV == targets_BC[..., None]).astype(jnp.float32)
    g_BCV = (jnp.exp(logits_BCV - lse_BC[..., None]) - onehot_BCV) * weights_BC[..., None]
    g_BCV = constrain(g_BCV.astype(w.dtype), _LOGITS)
    dx_BCD = jnp.einsum("BCV,DV->BCD", g_BCV, w_DV, preferred_element_type=jnp.float32)
    dw_DV = dw_DV + jnp.einsum("BCD,BCV->DV", x_BCD, g_BCV, preferred_element_type=dw_DV.dtype)
    return (total + loss, dw_DV), constrain(dx_BCD.astype(x_BTD.dtype), _X)

  zeros_DV = constrain(jnp.zeros(w_DV.shape, w.dtype), (None, "act_vocab"))
  (total, dw_DV), dx_nBCD = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros_DV), xs,
                                         unroll=unroll)
  dx_BTD = jnp.moveaxis(dx_nBCD, 0, 2).reshape(x_BTD.shape)
  dw = (dw_DV.T if vocab_major else dw_DV).astype(w.dtype)
  return total, (dx_BTD, dw)


def _xent_bwd(vocab_major, n, unroll, res, g):
  dx_BTD, dw = res
  return (g * dx_BTD).astype(dx_BTD.dtype), (g * dw).astype(dw.dtype), None, None


_xent.defvjp(_xent_fwd, _xent_bwd)
