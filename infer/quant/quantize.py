"""Round-to-nearest quantization, and replacing a model's float weights by QArrays.

`encode(w_KM, fmt)` is the reference quantizer (the RTN baseline); calibrated
methods (infer/quant/gptq.py) produce their own codes and scales and reuse
`to_qarray` for the storage layout.
"""

import jax.numpy as jnp
import numpy as np

from models.quant.formats import (QuantFormat, check_group, dequantize_values, pack_int4,
                                  quantize_values, scales_for)
from models.quant.qarray import QArray, arrange, to_matrix
from models.quant.rules import axes_of, params_by_path, quant_plan


def encode(w_KM: np.ndarray, fmt: QuantFormat, where: str = "weight", h_KK=None):
  """Round-to-nearest: (codes_GgM, scale_GM, offset_GM or None), codes unpacked. Given the
  inputs' second moment h_KK, each group's range is clipped to the least output error
  (formats.scales_for's search weighted by the group's block of h)."""
  k, m = w_KM.shape
  g = check_group(fmt, k, where)
  w_GgM = np.asarray(w_KM, np.float32).reshape(k // g, g, m)
  if h_KK is None:
    scale, offset = scales_for(w_GgM, fmt)
  else:
    h_Ggg = np.stack([h_KK[i:i + g, i:i + g] for i in range(0, k, g)])
    scale, offset = scales_for(w_GgM, fmt, True, h_Ggg)
  codes = quantize_values(w_GgM, scale[:, None], None if offset is None else offset[:, None], fmt)
  return codes, scale, offset


def decode(codes_GgM, scale_GM, offset_GM, fmt: QuantFormat) -> np.ndarray:
  """w_KM from unpacked codes: the inverse of encode up to rounding."""
  off = None if offset_GM is None else offset_GM[:, None]
  w = dequantize_values(codes_GgM, scale_GM[:, None], off, fmt)
  return w.reshape(-1, w.shape[-1])


def to_qarray(parts, fmt: QuantFormat, letters: str, in_letters: str, dims) -> QArray:
  """A QArray from per-layer (codes_GgM, scale_GM, offset_GM) triples, stacked on a lead axis
  when `parts` is a list (one per layer), unstacked when it is one triple."""
  stacked = isinstance(parts, list)
  parts = parts if stacked else [parts]
  pack = pack_int4 if fmt.bits == 4 else (lambda c: c)
  codes = np.stack([pack(c) for c, _, _ in parts])
  # float16 storage is exact: scales_for only makes float16 values (checked: codes made for
  # other scales would silently decode wrong).
  scale = _as_f16(np.stack([s for _, s, _ in parts]))
  offset = None if parts[0][2] is None else np.stack([o for _, _, o in parts])
  if offset is not None:
    offset = _as_zero_codes(offset, fmt) if fmt.int_zero else _as_f16(offset)
  if not stacked:
    codes, scale, offset = codes[0], scale[0], None if offset is None else offset[0]
  codes, scale, offset = arrange(codes, scale, offset, letters, in_letters)
  return QArray(jnp.asarray(codes), jnp.asarray(scale),
                None if offset is None else jnp.asarray(offset), fmt, letters, in_letters,
                tuple(int(d) for d in dims))


def _as_f16(a):
  h = np.asarray(a).astype(np.float16)
  if not np.array_equal(h.astype(np.float32), np.asarray(a, np.float32)):
    raise ValueError("quantization scales/offsets must be float16 values (see formats.scales_for)")
  return h


def _as_zero_codes(z, fmt: QuantFormat):
  u = np.asarray(z).astype(np.uint8)
  if not np.array_equal(u, z) or u.max(initial=0) >= fmt.levels:
    raise ValueError(f"zero points of {fmt.name} must be integers in [0, {fmt.levels - 1}]")
  return u


def layer_matrices(path: str, value) -> tuple[list[np.ndarray] | np.ndarray, tuple, bool]:
  """(w_KM per layer, or one w_KM; the parameter dims; stacked?) of a float parameter."""
  letters, in_letters = axes_of(path)
  w = np.asarray(value, np.float32)
  dims = w.shape[w.ndim - len(letters):]
  if w.ndim == len(letters):
    return to_matrix(w, letters, in_letters), dims, False
  lead = w.reshape((-1,) + dims)
  return [to_matrix(x, letters, in_letters) for x in lead], dims, True


def quantize_model(model, rules, *, fit_groups: bool = False, method=None) -> dict:
  """Replaces the weights the rules select by QArrays, in place; returns {path: format}.

  `method(path, layer_index, w_KM, fmt) -> (codes_GgM, scale_GM, offset_GM)`
  chooses the codes; the default is round-to-nearest (`encode`).
  """
  plan = quant_plan(model, rules, fit_groups=fit_groups)
  params = params_by_path(model)
  for path, fmt in plan.items():
    var = params[path]
    mats, dims, stacked = layer_matrices(path, var[...])
    letters, in_letters = axes_of(path)

    def one(i, w_KM, path=path, fmt=fmt):
      if not np.isfinite(w_KM).all():
        raise ValueError(f"{path}{'' if i is None else f' (layer {i})'} has NaN or Inf weights")
      if method is None:
        return encode(w_KM, fmt, path)
      return method(path, i, w_KM, fmt)

    parts = [one(i, w) for i, w in enumerate(mats)] if stacked else one(None, mats)
    var.set_value(to_qarray(parts, fmt, letters, in_letters, dims))
  return plan


def weight_bytes(model) -> int:
  """Bytes of every parameter as stored: QArrays count codes, scales and offsets."""
  from flax import nnx
  total = 0
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = var[...]
    total += value.nbytes if isinstance(value, QArray) else value.size * value.dtype.itemsize
  return int(total)
