"""One weight projection, y = einsum(spec, x, w), in the form that runs fastest where it runs.

`einsum` hands the spec to XLA as written; sharded meshes need exactly that,
since GSPMD propagates shardings through each named dimension. On a single CPU
device, XLA's CPU backend is faster with one plain 2-D matmul per projection
(x's batch dimensions flattened to M rows, the contracted ones to K columns,
w's own to N) and with a backward pass whose weight gradient multiplies a
materialised xᵀ instead of asking the dot for a transposed operand:
docs/results.md ("Training") has the numbers. Both forms compute
the same products; only the summation order of multi-dimension contractions
changes.
"""

import functools
import math

import jax
import jax.numpy as jnp

import parallel


def use_flat(matmul: str) -> bool:
  """`matmul` resolved: "auto" is flat on a one-device CPU process, einsum anywhere else
  (including a CPU host compiling for another target: parallel.platform)."""
  if matmul == "auto":
    return parallel.platform() == "cpu" and jax.device_count() == 1
  return matmul == "flat"


def einsum(spec: str, x, w, matmul: str = "einsum", **kwargs) -> jax.Array:
  """jnp.einsum(spec, x, w), or the same product as one flat matmul (module docstring)."""
  if not use_flat(matmul) or set(kwargs) - {"preferred_element_type"}:
    return jnp.einsum(spec, x, w, **kwargs)
  (x_perm, w_perm, m, k, n, y_shape, y_perm) = _plan(spec, x.shape, w.shape)
  x_MK = jnp.transpose(x, x_perm).reshape(m, k)
  w_KN = jnp.transpose(w, w_perm).reshape(k, n)
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(x, w)
  y_MN = _matmul(jnp.dtype(out_dtype), x_MK, w_KN)
  return jnp.transpose(y_MN.reshape(y_shape), y_perm)


def _plan(spec: str, x_shape, w_shape):
  """How `spec` maps to [M, K] x [K, N]: transposes, sizes, and the way back to its output."""
  inputs, out = spec.replace(" ", "").split("->")
  xs, ws = inputs.split(",")
  if (len(xs) != len(x_shape) or len(ws) != len(w_shape) or len(set(xs)) != len(xs)
      or len(set(ws)) != len(ws) or not set(out) <= set(xs + ws)):
    raise ValueError(f"einsum spec {spec!r} does not fit shapes {x_shape} and {w_shape}")
  contracted = [c for c in xs if c in ws and c not in out]
  rows = [c for c in xs if c not in contracted]
  cols = [c for c in ws if c not in contracted]
  if any(c in ws for c in rows) or sorted(rows + cols) != sorted(out):
    raise ValueError(f"einsum spec {spec!r} is not a projection x·w: every dimension x and w "
                     "share must be summed over, every other one kept")
  size = dict(zip(xs, x_shape)) | dict(zip(ws, w_shape))
  for c in contracted:
    if x_shape[xs.index(c)] != w_shape[ws.index(c)]:
      raise ValueError(f"einsum spec {spec!r}: dimension {c!r} is {x_shape[xs.index(c)]} in x "
                       f"but {w_shape[ws.index(c)]} in w")
  return ([xs.index(c) for c in rows + contracted], [ws.index(c) for c in contracted + cols],
          math.prod(size[c] for c in rows), math.prod(size[c] for c in contracted),
          math.prod(size[c] for c in cols), [size[c] for c in rows + cols],
          [(rows + cols).index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(out_dtype, x_MK, w_KN):
  return jnp.matmul(x_MK, w_KN, preferred_element_type=out_dtype)


def _matmul_fwd(out_dtype, x_MK, w_KN):
  return _matmul(out_dtype, x_MK, w_KN), (x_MK, w_KN)


def _matmul_bwd(out_dtype, res, g_MN):
  x_MK, w_KN = res
  # The barrier keeps xᵀ a real [K, M] array: folded into the dot instead, it makes
  # XLA:CPU take its slow transposed-operand path for the largest matmul of the step.
  x_KM = jax.lax.optimization_barrier(x_MK.T)
  return ((g_MN @ w_KN.T.astype(g_MN.dtype)).astype(x_MK.dtype),
          (x_KM.astype(g_MN.dtype) @ g_MN).astype(w_KN.dtype))


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
