"""QArray: a quantized weight that stands where a float parameter stood.

It sits inside the model's `nnx.Param` in place of the float array. The model's
projections (`models.layers.project`) see an object with `.einsum` and hand it
the contraction; `models.layers.lookup` hands it embedding row lookups. Both
dequantize inside the jitted computation, one layer (inside the layer scan) and
one weight at a time: the full-precision model is never built.

Storage is the weight as a matrix w_KM (K = contraction letters, M = output
letters, both in the parameter's own order), cut into G groups of g rows:

  codes   [*lead, G, g, M] int8/uint8 (INT8), or [*lead, G, g/2, M] uint8 (INT4, packed);
          output-major [*lead, M, G, g or g/2] (scale/offset [*lead, M, G]) for a weight
          whose first axis is an output, an embedding table: rows it looks up stay
          contiguous, and its logits matmul runs at CPU speed only in that order
  scale   [*lead, G, M] float16 (as GGUF stores it; exact: quantizers make float16 values)
  offset  [*lead, G, M] float16, asymmetric formats only (else None); for zero-point
          formats uint8, the zero code z

`lead` are stacked axes the arrays gain from the model (the layer axis); a
layer scan slices them off like any other parameter.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import parallel
from models.quant.formats import QuantFormat, dequantize_values

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
  codes: jax.Array
  scale: jax.Array
  offset: jax.Array | None
  fmt: QuantFormat = dataclasses.field(metadata=_STATIC)
  letters: str = dataclasses.field(metadata=_STATIC)      # the parameter's axes, e.g. "DNH"
  in_letters: str = dataclasses.field(metadata=_STATIC)   # contracted axes, e.g. "D"
  dims: tuple = dataclasses.field(metadata=_STATIC)       # the parameter's shape (no lead axes)

  # --- what a float parameter offers -------------------------------------------------------
  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError("a quantized weight supports only w[...]; use dequantize() for values")
    return self

  @property
  def shape(self) -> tuple:
    return tuple(self.codes.shape[:self._lead]) + tuple(self.dims)

  @property
  def dtype(self):
    return jnp.dtype(jnp.float32)

  @property
  def nbytes(self) -> int:
    arrays = [a for a in (self.codes, self.scale, self.offset) if a is not None]
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays))

  # --- shapes ------------------------------------------------------------------------------
  @property
  def out_letters(self) -> str:
    return "".join(c for c in self.letters if c not in self.in_letters)

  @property
  def _lead(self) -> int:
    return self.codes.ndim - 3

  def _size(self, letters) -> int:
    return math.prod(self.dims[self.letters.index(c)] for c in letters)

  @property
  def k(self) -> int:
    return self._size(self.in_letters)

  @property
  def m(self) -> int:
    return self._size(self.out_letters)

  # --- values ------------------------------------------------------------------------------
  @property
  def out_first(self) -> bool:
    """Codes keep the parameter's axis order: output-major when its first axis is an output
    (an embedding table, whose rows are looked up), else contraction-major."""
    return self.letters[0] not in self.in_letters

  @property
  def _row_axis(self) -> int:
    """The axis of the rows within a group (where INT4 nibbles pair up)."""
    return -1 if self.out_first else -2

  def _planes(self):
    """[(codes, x rows as slice of each group)]: INT4 gives its two nibble planes."""
    if self.fmt.bits == 8:
      return [(self.codes, slice(None))]
    half = self.codes.shape[self._row_axis]
    return [(self.codes & 15, slice(0, half)), (self.codes >> 4, slice(half, 2 * half))]

  def _dequant(self, codes, dtype):
    scale = jnp.expand_dims(self.scale, self._row_axis)
    offset = None if self.offset is None else jnp.expand_dims(self.offset, self._row_axis)
    return dequantize_values(codes, scale, offset, self.fmt, xp=jnp).astype(dtype)

  def grouped_values_int8(self):
    """The integer codes as int8, rows of each group in order (INT4: nibbles 0..15)."""
    parts = [c.astype(jnp.int8) for c, _ in self._planes()]
    return jnp.concatenate(parts, axis=self._row_axis) if len(parts) > 1 else parts[0]

  def grouped_values(self, dtype):
    """All values, rows of each group in order: [*lead, G, g, M] or [*lead, M, G, g]."""
    parts = [self._dequant(c, dtype) for c, _ in self._planes()]
    return jnp.concatenate(parts, axis=self._row_axis) if len(parts) > 1 else parts[0]

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The float weight in the parameter's layout (for tests and export; not on the hot path)."""
    lead = self.codes.shape[:self._lead]
    ordered = (self.out_letters + self.in_letters if self.out_first
               else self.in_letters + self.out_letters)
    w = self.grouped_values(dtype).reshape(lead + tuple(self.dims[self.letters.index(c)]
                                                        for c in ordered))
    perm = [ordered.index(c) for c in self.letters]
    return jnp.transpose(w, list(range(len(lead))) + [len(lead) + p for p in perm])

  def einsum(self, spec: str, x, dtype, preferred_element_type=None):
    """jnp.einsum(spec, x, w) with w dequantized group by group inside the computation.

    The spec contracts this weight's input letters, which end x in the
    weight's order; the output is x's other letters followed by the weight's
    output letters: 'BTD,DNH->BTNH', 'BTNH,NHD->BTD', 'BTD,VD->BTV'.
    """
    xs, rest = spec.replace(" ", "").split(",")
    ws, outs = rest.split("->")
    batch = xs[:len(xs) - len(self.in_letters)]
    if (ws != self.letters or not xs.endswith(self.in_letters)
        or outs != batch + self.out_letters or self._lead):
      raise ValueError(f"quantized einsum {spec!r} on a weight with axes {self.letters!r} "
                       f"(contracting {self.in_letters!r}, {self._lead} stacked axes): want "
                       f"'{batch}{self.in_letters},{self.letters}->{batch}{self.out_letters}'")
    groups = self.scale.shape[-1 if self.out_first else 0]
    x_NGg = x.reshape(-1, groups, self.k // groups).astype(dtype)
    # The integer dot reads the codes as they lie: no float slice to keep in cache; nor does
    # an accelerator's dot (matmul_groups), and a loop of slices would only serialize it.
    whole = self.fmt.act8 or parallel.platform() != "cpu"
    count, width = (1, self.m) if whole else _slices(self.k, self.m)
    if count <= 1:
      y_NM = self.matmul_groups(x_NGg, dtype, preferred_element_type)
    else:
      # A large weight (an LM head) is dequantized `width` outputs at a time, so each
      # float slice stays in cache instead of the whole float matrix streaming to memory.
      m_axis = 0 if self.out_first else -1
      body = self._cut(0, count * width, m_axis, (count, width))
      y_CNM = jax.lax.map(lambda q: q.matmul_groups(x_NGg, dtype, preferred_element_type), body)
      y_NM = jnp.moveaxis(y_CNM, 0, 1).reshape(x_NGg.shape[0], count * width)
      if count * width < self.m:
        tail = self._cut(count * width, self.m, m_axis, None)
        y_tail = tail.matmul_groups(x_NGg, dtype, preferred_element_type)
        y_NM = jnp.concatenate([y_NM, y_tail], -1)
    return y_NM.reshape(x.shape[:len(batch)] + tuple(self.dims[self.letters.index(c)]
                                                     for c in self.out_letters))

  def _cut(self, start, stop, m_axis, split):
    """Outputs [start, stop) of every array, optionally split to a leading [count, width]."""
    def cut(a):
      if a is None:
        return None
      a = jax.lax.slice_in_dim(a, start, stop, axis=m_axis % a.ndim)
      if split is None:
        return a
      if m_axis == 0:
        return a.reshape(split + a.shape[1:])
      return jnp.moveaxis(a.reshape(a.shape[:-1] + split), -2, 0)
    return dataclasses.replace(self, codes=cut(self.codes), scale=cut(self.scale),
                               offset=cut(self.offset))

  def matmul_groups(self, x_NGg, dtype, preferred_element_type):
    """y_NM = x @ w for x already cut into this weight's G groups of g rows (see `einsum`)."""
    if self.fmt.act8:
      return self.int_matmul_groups(x_NGg).astype(preferred_element_type or dtype)
    if parallel.platform() != "cpu":
      return self.scaled_matmul_groups(x_NGg, dtype).astype(preferred_element_type or dtype)
    # One contraction axis (groups and rows flattened): XLA:CPU runs a dot with two
    # contracting axes several times slower.
    y_NM = None
    for codes, rows in self._planes():
      x_NR = x_NGg[:, :, rows].reshape(x_NGg.shape[0], -1)
      w = self._dequant(codes, dtype)
      if self.out_first:
        part = jnp.einsum("NR,MR->NM", x_NR, w.reshape(w.shape[0], -1),
                          preferred_element_type=preferred_element_type or jnp.float32)
      else:
        part = jnp.einsum("NR,RM->NM", x_NR, w.reshape(-1, w.shape[-1]),
                          preferred_element_type=preferred_element_type or jnp.float32)
      y_NM = part if y_NM is None else y_NM + part
    return y_NM.astype(preferred_element_type or dtype)

  def scaled_matmul_groups(self, x_NGg, dtype) -> jax.Array:
    """Weight-only, for an accelerator: the codes enter the dot converted to `dtype` (exact:
    at most 8 bits) and the scales apply to its [G, N, M] output, y = sum_G scale (D - z X)
    (+ offset X), D = sum_g x u, X = sum_g x. So the compiler reads the codes inside the
    dot, once; the CPU path (dequantize, then multiply, in slices under a loop) made the TPU
    compiler copy the codes to another layout and serialize the slices: a decode row's
    [2048, 8192] projection accessed 2.6x (INT8) and 11x (INT4) the stored bytes."""
    d_GNM = None
    for codes, rows in self._planes():
      u = codes.astype(dtype)
      spec = "NGr,MGr->GNM" if self.out_first else "NGr,GrM->GNM"
      part = jnp.einsum(spec, x_NGg[:, :, rows], u, preferred_element_type=jnp.float32)
      d_GNM = part if d_GNM is None else d_GNM + part
    x_GN1 = jnp.sum(x_NGg.astype(jnp.float32), axis=-1).T[..., None]
    return jnp.sum(self._scaled_groups(d_GNM, x_GN1), axis=0)

  def int_matmul_groups(self, x_NGg) -> jax.Array:
    """W8A8 / W4A8: x quantized to int8 per row and group (absmax), an int32 dot with the
    codes per group, then the scales: y = sum_G s_x (scale (D - z X) + offset X), with
    D = sum_g x_q u and X = sum_g x_q over each group. Exact in int32 up to K ~ 1.3e5."""
    n, groups, _ = x_NGg.shape
    x_NGg = x_NGg.astype(jnp.float32)
    s_NG = jnp.max(jnp.abs(x_NGg), axis=-1) / 127
    s_NG = jnp.where(s_NG == 0, 1.0, s_NG)
    q_NGg = jnp.clip(jnp.round(x_NGg / s_NG[..., None]), -127, 127).astype(jnp.int8)
    # XLA:CPU hands an s8 x s8 dot to YNNPACK's integer kernels only with two rows or more;
    # one row (a decode step) would convert the whole weight to int32 instead.
    rows = max(n, 2)
    # INT4: both nibble planes unpacked into one int8 [G, g, M] weight (one dot of depth g).
    w = self.grouped_values_int8()
    if groups == 1:  # one plain 2-D dot, the form YNNPACK takes directly
      w_2 = w.reshape(w.shape[0], -1) if self.out_first else w.reshape(-1, w.shape[-1])
      dims = (((1,), (1 if self.out_first else 0,)), ((), ()))
      q_RK = jnp.pad(q_NGg.reshape(n, -1), ((0, rows - n), (0, 0)))
      d_GRM = jax.lax.dot_general(q_RK, w_2, dims,
                                  preferred_element_type=jnp.int32)[None]
    else:
      dims = (((2,), (2 if self.out_first else 1,)), ((0,), (1 if self.out_first else 0,)))
      # Groups first, materialized (the barrier keeps XLA from folding the transpose into
      # the dot's operand layout): a transposed operand keeps XLA:CPU from handing the dot
      # to YNNPACK, and it then converts the whole weight to int32 instead.
      q_GRg = jnp.pad(jnp.swapaxes(q_NGg, 0, 1), ((0, 0), (0, rows - n), (0, 0)))
      q_GRg = jax.lax.optimization_barrier(q_GRg)
      d_GRM = jax.lax.dot_general(q_GRg, w, dims, preferred_element_type=jnp.int32)
    d_GNM = d_GRM[:, :n]
    x_GN1 = jnp.sum(q_NGg.astype(jnp.int32), axis=-1).T[..., None]
    return jnp.einsum("GNM,NG->NM", self._scaled_groups(d_GNM, x_GN1), s_NG)

  def _scaled_groups(self, d_GNM, x_GN1) -> jax.Array:
    """Per group, float32 [G, N, M]: scale (D - z X), or scale D + offset X with float
    offsets, from D = sum_g x u over the codes and X = sum_g x (integer D, X stay exact until
    the scales: the -a8 path)."""
    per_group = (lambda a: a.T) if self.out_first else (lambda a: a)  # [G, M]
    scale_G1M = per_group(self.scale.astype(jnp.float32))[:, None]
    fmt = self.fmt
    if fmt.symmetric or fmt.int_zero:
      zero = (per_group(self.offset.astype(jnp.int32))[:, None] if fmt.int_zero
              else 0 if fmt.signed_codes else 8 if fmt.bits == 4 else 128)
      return scale_G1M * (d_GNM - zero * x_GN1).astype(jnp.float32)
    offset_G1M = per_group(self.offset.astype(jnp.float32))[:, None]
    return scale_G1M * d_GNM.astype(jnp.float32) + offset_G1M * x_GN1.astype(jnp.float32)

  def take(self, ids, dtype) -> jax.Array:
    """jnp.take(w, ids, axis=0) for a weight whose first axis is its only output axis."""
    if self.out_letters != self.letters[0] or self._lead:
      raise ValueError(f"row lookup needs the first axis to be the only output axis; "
                       f"this weight has axes {self.letters!r} contracting {self.in_letters!r}")
    flat = ids.reshape(-1)
    picked = dataclasses.replace(self, codes=jnp.take(self.codes, flat, axis=0),
                                 scale=jnp.take(self.scale, flat, axis=0),
                                 offset=None if self.offset is None
                                 else jnp.take(self.offset, flat, axis=0))
    return picked.grouped_values(dtype).reshape(ids.shape + (self.k,))


# Weights above this many elements are multiplied in slices of outputs (see QArray.einsum).
CHUNK_ELEMENTS = 1 << 21


def _slices(k: int, m: int) -> tuple[int, int]:
  """(count, width): `count` slices of `width` outputs, each about CHUNK_ELEMENTS elements or
  fewer. Equal slices covering all m when some count up to twice the least does (slicing
  off a remainder copies the codes every call); else outputs past count·width (fewer than
  width) are multiplied on their own."""
  least = -(-k * m // CHUNK_ELEMENTS)
  if least <= 1:
    return 1, m
  for count in range(least, 2 * least + 1):
    if m % count == 0:
      return count, m // count
  width = max(1, CHUNK_ELEMENTS // k)
  return m // width, width


def arrange(codes_GrM, scale_GM, offset_GM, letters: str, in_letters: str):
  """Contraction-major group arrays ([*lead, G, r, M], [*lead, G, M]) in the storage layout
  QArray uses for this parameter (output-major [*lead, M, G, r] for an embedding table)."""
  if letters[0] in in_letters:
    return codes_GrM, scale_GM, offset_GM
  codes = np.ascontiguousarray(np.moveaxis(codes_GrM, -1, -3))
  scale = np.ascontiguousarray(np.moveaxis(scale_GM, -1, -2))
  offset = None if offset_GM is None else np.ascontiguousarray(np.moveaxis(offset_GM, -1, -2))
  return codes, scale, offset


def to_matrix(w: np.ndarray, letters: str, in_letters: str) -> np.ndarray:
  """A parameter (no lead axes) as w_KM: contraction letters first, both groups in order."""
  out = "".join(c for c in letters if c not in in_letters)
  perm = [letters.index(c) for c in in_letters + out]
  k = math.prod(w.shape[letters.index(c)] for c in in_letters)
  return np.transpose(w, perm).reshape(k, -1)
