"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized: raw blocks -> QArray, no float copy.

GGUF stores a weight [rows, cols] (Hugging Face's [out, in]) row by row, each
row cut into blocks of 32 columns:

  Q4_0  f16 d, 16 bytes          w = (u - 8)·d      -> int4-g32        scale = d
  Q4_1  f16 d, f16 m, 16 bytes   w = u·d + m        -> int4-g32-asym   scale = d, offset = m
  Q8_0  f16 d, 32 int8           w = q·d            -> int8-g32        scale = d, codes q + 128

Q4 byte j holds column j in its low nibble and column j + 16 in its high one:
QArray's packed INT4 layout already, so codes are only transposed, never
repacked (Q8_0 bytes get their sign bit flipped: QArray keeps uint8 q + 128).
The token embedding keeps GGUF's row-major order (QArray.out_first). Every projection's contraction is Hugging Face's `in` axis (columns)
and its output the `out` axis (rows), in the parameter's letter order (see
hf_io.params_from_hf), so a block column is a QArray group G and a row an
output column M. llama.cpp's RoPE permutation of Q/K rows is undone by
permuting M. Scales stay float16, so `dequantize()` gives the float load's
values bit for bit.
"""

import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import hf_io
from models.gguf_io import unpermute_rope
from models.quant.formats import parse_format
from models.quant.qarray import QArray, arrange
from models.quant.rules import CONTRACTS

BLOCK = 32


def _formats():
  from gguf import GGMLQuantizationType as QT
  return {QT.Q4_0: "int4-g32", QT.Q4_1: "int4-g32-asym", QT.Q8_0: "int8-g32"}


def _f16(b):
  """[..., 2] bytes -> [...] float16 (little-endian, as GGUF stores it and QArray keeps it)."""
  return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def block_parts(data, fmt_name: str, rows: int, cols: int, heads: int | None = None):
  """(codes_GhM, scale_GM, offset_GM or None) of one GGUF tensor's raw blocks.

  codes are packed nibbles [G, 16, rows] (INT4) or q + 128 as uint8 [G, 32, rows] (INT8);
  `heads` undoes llama.cpp's RoPE row permutation (Q/K projections).
  """
  if cols % BLOCK:
    raise ValueError(f"GGUF tensor with {cols} columns is not a whole number of {BLOCK}-blocks")
  blocks_RGb = np.asarray(data, np.uint8).reshape(rows, cols // BLOCK, -1)
  scale_RG, offset_RG = _f16(blocks_RGb[..., 0:2]), None
  if fmt_name == "int4-g32-asym":
    offset_RG, codes_RGh = _f16(blocks_RGb[..., 2:4]), blocks_RGb[..., 4:]
  elif fmt_name == "int4-g32":
    codes_RGh = blocks_RGb[..., 2:]
  else:
    codes_RGh = blocks_RGb[..., 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q + 128, exact
  want = BLOCK // 2 if fmt_name.startswith("int4") else BLOCK
  if codes_RGh.shape[-1] != want:
    raise ValueError(f"GGUF {fmt_name} blocks of {blocks_RGb.shape[-1]} bytes: expected "
                     f"{want} code bytes per block, found {codes_RGh.shape[-1]}")
  # rows -> M last; a row permutation is a gather on M, exact.
  rows_M = np.arange(rows) if heads is None else unpermute_rope(np.arange(rows), heads)
  codes_GhM = np.ascontiguousarray(codes_RGh.transpose(1, 2, 0)[..., rows_M])
  scale_GM = np.ascontiguousarray(scale_RG.T[:, rows_M])
  offset_GM = None if offset_RG is None else np.ascontiguousarray(offset_RG.T[:, rows_M])
  return codes_GhM, scale_GM, offset_GM


def _tensor_format(tensors, names) -> str | None:
  """The one QArray format all of these GGUF tensors share, or None (load them as float)."""
  formats = _formats()
  if any(n not in tensors.tensors for n in names):
    return None  # params_from_hf names the missing tensor
  kinds = {tensors.tensors[n].tensor_type for n in names}
  if len(kinds) > 1 and kinds <= set(formats):
    warnings.warn(f"GGUF tensors {names[0]}... mix types {sorted(k.name for k in kinds)}; "
                  "one stacked parameter holds one format, so they load as float")
  return formats.get(kinds.pop()) if len(kinds) == 1 else None


def quantized_params(tensors, abstract_params) -> tuple[dict, set]:
  """({param path: QArray}, GGUF tensor names used) for the projections and embeddings
  stored as Q4_0/Q4_1/Q8_0; everything else (norms, F16/F32 tensors) is left to the
  float path. `tensors` is a gguf_io.GGUFTensors, `abstract_params` the model's Param state.
  """
  cfg = tensors.cfg
  table, out, used = hf_io.name_table(cfg), {}, set()
  for path, var in nnx.to_flat_state(abstract_params):
    name = str(path[-1])
    if name not in CONTRACTS:
      continue  # norms stay float
    template, _ = hf_io.lookup_name(table, path)
    shape = tuple(var.get_value().shape)
    stacked = template.count("{")
    hf_names = [template.format(*i) for i in np.ndindex(*shape[:stacked])]
    fmt_name = _tensor_format(tensors, hf_names)
    if fmt_name is None:
      continue
    letters, in_letters = name.rsplit("_", 1)[-1], CONTRACTS[name]
    dims = shape[stacked:]
    k = int(np.prod([dims[letters.index(c)] for c in in_letters]))
    m = int(np.prod(dims)) // k
    parts = []
    for hf_name in hf_names:
      t = tensors.tensors[hf_name]
      cols, rows = (int(n) for n in t.shape)  # GGUF lists dims fastest-first
      if (rows, cols) != (m, k):
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {(rows, cols)}, but the "
                         f"config implies {(m, k)}")
      parts.append(block_parts(t.data, fmt_name, rows, cols, tensors.rope_heads(hf_name)))
    codes, scale, offset = (None if parts[0][i] is None else np.stack([p[i] for p in parts])
                            for i in range(3))
    codes, scale, offset = (a.reshape(shape[:stacked] + a.shape[1:]) if a is not None else None
                            for a in (codes, scale, offset))
    codes, scale, offset = arrange(codes, scale, offset, letters, in_letters)
    out[path] = QArray(jnp.asarray(codes), jnp.asarray(scale),
                       None if offset is None else jnp.asarray(offset),
                       parse_format(fmt_name), letters, in_letters, tuple(int(d) for d in dims))
    used.update(hf_names)
  return out, used
