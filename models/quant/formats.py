"""Weight formats: INT8 per output channel, INT4 in groups along the contraction axis.

A weight is viewed as a matrix w_KM: K the contraction (input) size, M the
output size. Groups of `group` consecutive rows of K share one scale per output
column (INT8 default: one group spanning all of K, i.e. per output channel).

  symmetric   w ≈ scale · q,            q ∈ [-127, 127] (INT8) or [-8, 7] (INT4)
  asymmetric  w ≈ scale · u + offset,   u ∈ [0, 2^bits - 1]  (offset = group min)
  zero-point  w ≈ scale · (u - z),      u, z ∈ [0, 2^bits - 1] (z an integer per group)

Asymmetric ("-asym") stores a float16 offset per group, as GGUF's Q4_1 does;
zero-point ("-zp") stores the offset as an integer code z, one byte per group,
as GPTQ and AWQ checkpoints do: the same grid shape for 8 bits instead of 16.

Round-to-nearest scales: INT8 absmax/127; symmetric INT4 as llama.cpp's Q4_0,
the group's signed extreme m at code -8 exactly (scale -m/8), which measured
better than absmax/7.5 (SmolLM2 int4-g128 RTN perplexity 17.1 against 21.8);
asymmetric min/max.

INT4 is stored as unsigned nibbles u (symmetric: q = u - 8, the GGUF Q4_0
convention) packed two per byte. Within each group, byte j holds row j in its
low nibble and row j + group/2 in its high nibble: the GGUF Q4 block layout,
which also lets the matmul use the two nibble planes as two dense halves.

"-a8" (W8A8, W4A8) multiplies in integers: the activations are quantized per token and
group to int8 inside the computation, and the product is an int32 dot followed by the
scales (QArray.einsum). Its INT8 weights are symmetric and stored as signed codes q, the
int8 operand of that dot; INT4 nibbles are unpacked to int8 as they are multiplied.
"""

import dataclasses
import re

import numpy as np

_NAME = re.compile(r"^int(8|4)(?:-g(\d+))?(-asym|-zp)?(-a8)?$")


@dataclasses.dataclass(frozen=True)
class QuantFormat:
  bits: int                 # 8 or 4
  group: int | None = None  # rows of K per scale; None: all of K (per output channel)
  symmetric: bool = True
  int_zero: bool = False    # asymmetric with an integer zero point z (offset = -z·scale)
  act8: bool = False        # int8 activations, integer matmul (W8A8 / W4A8)

  def __post_init__(self):
    if self.bits not in (4, 8):
      raise ValueError(f"quantization bits={self.bits}: only 8 and 4 are supported")
    if self.group is not None and (self.group < 2 or self.group % 2):
      raise ValueError(f"group size {self.group} must be an even number >= 2")
    if self.bits == 4 and self.group is None:
      raise ValueError("INT4 needs a group size, e.g. int4-g128")
    if self.int_zero and self.symmetric:
      raise ValueError("an integer zero point is an asymmetric format (symmetric=False)")
    if self.act8 and self.bits == 8 and not self.symmetric:
      raise ValueError("W8A8 (-a8) takes symmetric INT8 weights, whose codes are the int8 "
                       "operand of the integer dot: use int8-a8 or int8-gN-a8")

  @property
  def name(self) -> str:
    g = f"-g{self.group}" if self.group else ""
    kind = "" if self.symmetric else "-zp" if self.int_zero else "-asym"
    return f"int{self.bits}{g}{kind}{'-a8' if self.act8 else ''}"

  @property
  def signed_codes(self) -> bool:
    """Codes stored as int8 q (W8A8), not as unsigned q + 128."""
    return self.act8 and self.bits == 8

  @property
  def levels(self) -> int:
    return 1 << self.bits

  def group_for(self, k: int) -> int:
    return self.group or k



def parse_format(name: str) -> QuantFormat:
  """'int8', 'int8-asym', 'int4-g128', 'int4-g32-asym', 'int4-g128-zp', 'int8-a8', ...
  -> QuantFormat."""
  m = _NAME.match(str(name))
  if not m:
    raise ValueError(f"unknown quantization format {name!r}; use int8[-gN][-asym|-zp] or "
                     "int4-gN[-asym|-zp] with an optional -a8 (int8 activations), e.g. int8, "
                     "int4-g128, int4-g32-asym, int4-g128-zp, int8-a8, int4-g64-a8")
  bits, group, kind = int(m.group(1)), m.group(2), m.group(3)
  return QuantFormat(bits, int(group) if group else None, kind is None, kind == "-zp",
                     m.group(4) is not None)


def check_group(fmt: QuantFormat, k: int, where: str) -> int:
  """The group size for a contraction of k rows; refuses one that does not divide k."""
  g = fmt.group_for(k)
  if k % g:
    raise ValueError(f"{where}: group size {g} ({fmt.name}) does not divide the contraction "
                     f"dimension {k}; pick a group that divides {k}")
  return g


def _f16(x, direction):
  """x rounded to a float16 value (kept as float32) toward +inf (direction 1) or -inf (-1)."""
  y = np.asarray(x, np.float32).astype(np.float16)
  off = (y.astype(np.float32) < x) if direction > 0 else (y.astype(np.float32) > x)
  y = np.where(off, np.nextafter(y, np.float16(direction * np.inf)), y)
  if not np.isfinite(y).all():
    raise ValueError("a weight group's scale or offset overflows float16 (|w| > 6e4)")
  return y.astype(np.float32)


# Range shrink factors tried by scales_for(..., search=True).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def scales_for(w_GgM: np.ndarray, fmt: QuantFormat, search: bool = False, h_Ggg=None):
  """(scale_GM, offset_GM or None) for round-to-nearest over each group (axis 1); for
  zero-point formats the offset is the zero code z (float32 holding integers).

  Scales and offsets are stored as float16 (as GGUF does): the scale is rounded
  up and the offset down to float16 values, so every weight still quantizes
  within half a step of the stored grid. `search` instead picks, per group and
  column, the shrink of the range in CLIP_GRID with the least squared error
  (clipping a few outliers for a finer grid), as calibrated methods do; given
  the inputs' second moment over each group's rows, h_Ggg, the error is the
  group's share of the output error, dᵀ·h·d, so rows with more input energy
  weigh more (AWQ's clipping search measures it on the outputs too).
  """
  if search:
    best, best_err = None, None
    for alpha in CLIP_GRID:
      scale, offset = scales_for(w_GgM * alpha, fmt)
      off = None if offset is None else offset[:, None]
      codes = quantize_values(w_GgM, scale[:, None], off, fmt)
      d_GgM = dequantize_values(codes, scale[:, None], off, fmt) - w_GgM
      if h_Ggg is None:
        err = (d_GgM ** 2).sum(axis=1)
      else:
        err = np.einsum("Ggm,Ggh,Ghm->Gm", d_GgM, h_Ggg, d_GgM, optimize=True)
      if best is None:
        best, best_err = (scale, offset), err
        continue
      better = err < best_err
      best_err = np.where(better, err, best_err)
      best = (np.where(better, scale, best[0]),
              None if offset is None else np.where(better, offset, best[1]))
    return best
  if fmt.symmetric and fmt.bits == 8:
    scale = _f16(np.abs(w_GgM).max(axis=1) / 127, 1)
    return np.where(scale == 0, 1.0, scale).astype(np.float32), None
  if fmt.symmetric:
    # INT4 codes span [-8, 7]: as llama.cpp's Q4_0, the group's extreme value m maps to code
    # -8 exactly (scale = -m/8, negative when m > 0); values of the other sign round to
    # within half a step unless they reach past 7.5 steps, where they clip (at most a step).
    m = np.take_along_axis(w_GgM, np.abs(w_GgM).argmax(axis=1)[:, None], axis=1)[:, 0]
    scale = np.sign(m) * -_f16(np.abs(m) / 8, 1)
    return np.where(scale == 0, 1.0, scale).astype(np.float32), None
  if fmt.int_zero:
    # The range is widened to include 0 so that z = -lo/scale falls in [0, levels - 1];
    # rounding z moves the grid by under half a step, which the ends still cover.
    lo, hi = np.minimum(w_GgM.min(axis=1), 0), np.maximum(w_GgM.max(axis=1), 0)
    scale = _f16((hi - lo) / (fmt.levels - 1), 1)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    return scale, np.clip(np.rint(-lo / scale), 0, fmt.levels - 1).astype(np.float32)
  lo = _f16(w_GgM.min(axis=1), -1)
  scale = _f16((w_GgM.max(axis=1) - lo) / (fmt.levels - 1), 1)
  return np.where(scale == 0, 1.0, scale).astype(np.float32), lo


def quantize_values(w, scale, offset, fmt: QuantFormat):
  """Unsigned codes u of w given its group's scale/offset (broadcasting); symmetric codes are
  offset (q + 128 for INT8, q + 8 for INT4), as XLA:CPU converts uint8 to float far faster
  than int8, except W8A8's signed q (the integer dot's operand)."""
  if fmt.symmetric:
    lo, hi = (-127, 127) if fmt.bits == 8 else (-8, 7)
    q = np.clip(np.rint(w / scale), lo, hi)
    if fmt.signed_codes:
      return q.astype(np.int8)
    return (q + (8 if fmt.bits == 4 else 128)).astype(np.uint8)
  if fmt.int_zero:   # `offset` is the zero code z
    return np.clip(np.rint(w / scale) + offset, 0, fmt.levels - 1).astype(np.uint8)
  u = np.clip(np.rint((w - offset) / scale), 0, fmt.levels - 1)
  return u.astype(np.uint8)


def dequantize_values(codes, scale, offset, fmt: QuantFormat, xp=np):
  """Float values of integer codes (numpy or jax.numpy through `xp`)."""
  c = codes.astype(xp.float32)
  if fmt.symmetric:
    return (c - (0.0 if fmt.signed_codes else 8.0 if fmt.bits == 4 else 128.0)) * scale
  if fmt.int_zero:   # `offset` is the zero code z
    return (c - offset.astype(xp.float32)) * scale
  return c * scale + offset


def pack_int4(u_GgM):
  """Nibbles [G, g, M] (values 0..15) -> bytes [G, g/2, M]: low = rows :g/2, high = rows g/2:."""
  u = np.asarray(u_GgM, np.uint8)
  if u.max(initial=0) > 15:
    raise ValueError("pack_int4 takes values in [0, 15]")
  half = u.shape[1] // 2
  return (u[:, :half] | (u[:, half:] << 4)).astype(np.uint8)


def unpack_int4(p_GhM, xp=np):
  """Bytes [G, g/2, M] -> nibbles [G, g, M] in row order (the inverse of pack_int4)."""
  return xp.concatenate([p_GhM & 15, p_GhM >> 4], axis=1)
