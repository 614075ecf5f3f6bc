"""QArray: a quantized weight that stands where a float parameter stood.

It sits inside the model's `nnx.Param` in place of the float array. The model's
projections (`models.layers.project`) see an object with `.einsum` and hand it
the contraction; `models.layers.lookup` hands it embedding row lookups. Both
dequantize inside the jitted computation, one layer (inside the layer scan) and
one weight at a time: the full-precision model is never built.

Storage is the weight as a matrix w_KM (K = contraction letters, M = output
letters, both in the parameter's own order), cut into G groups of g rows:

  codes   [*lead, G, g, M] int8/uint8 (INT8), or [*lead, G, g/2, M] uint8 (INT4, packed)
  scale   [*lead, G, M] float16 (as GGUF stores it; exact: quantizers make float16 values)
  offset  [*lead, G, M] float16, asymmetric formats only (else None)

`lead` are stacked axes the arrays gain from the model (the layer axis); a
layer scan slices them off like any other parameter.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from infer.quant.formats import QuantFormat, dequantize_values

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
  def _planes(self):
    """[(codes_GhM, x rows as slice of each group)]: INT4 gives its two nibble planes."""
    if self.fmt.bits == 8:
      return [(self.codes, slice(None))]
    half = self.codes.shape[-2]
    return [(self.codes & 15, slice(0, half)), (self.codes >> 4, slice(half, 2 * half))]

  def _dequant(self, codes, dtype):
    scale = self.scale[..., None, :]
    offset = None if self.offset is None else self.offset[..., None, :]
    return dequantize_values(codes, scale, offset, self.fmt, xp=jnp).astype(dtype)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The float weight in the parameter's layout (for tests and export; not on the hot path)."""
    parts = [self._dequant(c, dtype) for c, _ in self._planes()]
    w = jnp.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
    lead = self.codes.shape[:self._lead]
    ordered = self.in_letters + self.out_letters
    w = w.reshape(lead + tuple(self.dims[self.letters.index(c)] for c in ordered))
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
    if (sorted(ws) != sorted(self.letters) or not xs.endswith(self.in_letters)
        or outs != batch + self.out_letters or self._lead):
      raise ValueError(f"quantized einsum {spec!r} on a weight with axes {self.letters!r} "
                       f"(contracting {self.in_letters!r}, {self._lead} stacked axes): want "
                       f"'{batch}{self.in_letters},{self.letters}->{batch}{self.out_letters}'")
    g_count = self.scale.shape[0]
    x_NGg = x.reshape(-1, g_count, self.k // g_count).astype(dtype)
    chunks = _chunks(self.k, self.m)
    if chunks == 1:
      y_NM = self._matmul(x_NGg, self, dtype, preferred_element_type)
    else:
      # A large weight (an LM head) is dequantized a slice of columns at a time, so the
      # float slice stays in cache instead of streaming the whole float matrix to memory.
      def split(a):
        return None if a is None else jnp.moveaxis(a.reshape(a.shape[:-1] + (chunks, -1)), -2, 0)
      sliced = dataclasses.replace(self, codes=split(self.codes), scale=split(self.scale),
                                   offset=split(self.offset))
      y_CNM = jax.lax.map(lambda q: self._matmul(x_NGg, q, dtype, preferred_element_type),
                          sliced)
      y_NM = jnp.moveaxis(y_CNM, 0, 1).reshape(x_NGg.shape[0], self.m)
    return y_NM.reshape(x.shape[:len(batch)] + tuple(self.dims[self.letters.index(c)]
                                                     for c in self.out_letters))

  @staticmethod
  def _matmul(x_NGg, q, dtype, preferred_element_type):
    y_NM = None
    for codes_GhM, rows in q._planes():
      w_GhM = q._dequant(codes_GhM, dtype)
      part = jnp.einsum("NGh,GhM->NM", x_NGg[:, :, rows], w_GhM,
                        preferred_element_type=preferred_element_type)
      y_NM = part if y_NM is None else y_NM + part
    return y_NM

  def take(self, ids, dtype) -> jax.Array:
    """jnp.take(w, ids, axis=0) for a weight whose first axis is its only output axis."""
    if self.out_letters != self.letters[0] or self._lead:
      raise ValueError(f"row lookup needs the first axis to be the only output axis; "
                       f"this weight has axes {self.letters!r} contracting {self.in_letters!r}")
    flat = ids.reshape(-1)
    picked = dataclasses.replace(self, codes=jnp.take(self.codes, flat, axis=-1),
                                 scale=jnp.take(self.scale, flat, axis=-1),
                                 offset=None if self.offset is None
                                 else jnp.take(self.offset, flat, axis=-1))
    parts = [picked._dequant(c, dtype) for c, _ in picked._planes()]
    w_GgN = jnp.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
    return w_GgN.reshape(self.k, -1).T.reshape(ids.shape + (self.k,))


# Weights above this many elements are multiplied in column slices (see QArray.einsum).
CHUNK_ELEMENTS = 1 << 21


def _chunks(k: int, m: int) -> int:
  """How many equal column slices keep each under CHUNK_ELEMENTS (1 for small weights)."""
  n = -(-k * m // CHUNK_ELEMENTS)
  while n > 1 and m % n:
    n += 1
  return max(n, 1)


def to_matrix(w: np.ndarray, letters: str, in_letters: str) -> np.ndarray:
  """A parameter (no lead axes) as w_KM: contraction letters first, both groups in order."""
  out = "".join(c for c in letters if c not in in_letters)
  perm = [letters.index(c) for c in in_letters + out]
  k = math.prod(w.shape[letters.index(c)] for c in in_letters)
  return np.transpose(w, perm).reshape(k, -1)
