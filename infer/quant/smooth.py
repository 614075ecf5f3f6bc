"""SmoothQuant-style smoothing (Xiao et al., 2023) before integer-activation quantization.

The -a8 formats quantize each token's activations to int8 with one absmax step per row
(and group; models/quant/qarray.py). A few outlier channels set that step, and every
other channel keeps few levels: SmolLM2 at int8-a8 by round-to-nearest loses 3.0% of
perplexity where weight-only int8 loses none. Smoothing divides input channel c by s_c
and multiplies the weight rows reading it by s_c, folded into the op that feeds them
(AWQ's pairs, infer/quant/awq.py), so the float model computes what it did and the
checkpoint keeps its format:

  s_c = max|x_c|^α / max|w_c|^(1-α)     (normalised so that max(s)·min(s) = 1)

SmoothQuant fixes α (0.5). Here α ∈ {0, 1/n, ..., (n-1)/n}, or no smoothing, is chosen per
pair and layer for the least output error of the quantized product on sampled
calibration rows, Σ ||Q_a(X/s) Q_w(sW) − XW||², summed over the projections that share
the input: Q_w the weight's own format (round-to-nearest), Q_a per-row absmax int8 over
the format's groups.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from infer.quant.awq import PAIRS, feeding_channel, fold
from infer.quant.gptq import BlockHessians
from infer.quant.quantize import decode, encode, quantize_model
from models.quant.qarray import to_matrix
from models.quant.rules import axes_of, contraction_size, params_by_path, quant_plan


class _Stats:
  """Stands in for a float weight during calibration: keeps its inputs' per-channel absmax
  and up to `rows` of their rows, spread over the calibration batches."""

  def __init__(self, value, sink: dict, key: str, rows: int):
    self.value, self.sink, self.key, self.rows = value, sink, key, rows

  def __getitem__(self, index):
    return self

  def einsum(self, spec, x, dtype, **kwargs):
    x_NK = jnp.reshape(x, (-1, contraction_size(self.key, self.value.shape))).astype(jnp.float32)
    amax_K, kept = self.sink.get(self.key, (None, []))
    this_K = np.asarray(jnp.max(jnp.abs(x_NK), axis=0))
    amax_K = this_K if amax_K is None else np.maximum(amax_K, this_K)
    stride = max(1, x_NK.shape[0] * self.sink["_calls"] // self.rows)
    kept.append(np.asarray(x_NK[::stride]))
    self.sink[self.key] = (amax_K, kept)
    return jnp.einsum(spec, x, self.value.astype(dtype), **kwargs)


def input_stats(rows: int, calls: int):
  """A BlockHessians `record` function: ({path: (amax_K, x_RK)}, outputs), about `rows` input
  rows per weight from `calls` calibration batches."""

  def record(module, paths, run):
    variables, sink = params_by_path(module), {"_calls": calls}
    originals = {p: variables[p][...] for p in paths}
    for p, value in originals.items():
      variables[p].set_value(_Stats(value, sink, p, rows))
    try:
      out = run(module)
    finally:
      for p, value in originals.items():
        variables[p].set_value(value)
    return {p: (sink[p][0], np.concatenate(sink[p][1])[:rows]) for p in paths}, out

  return record


@functools.partial(jax.jit, static_argnames=("groups",))
def _product_error(x_RK, w_KM, q_KM, s_K, groups: int):
  """||Q_a(x/s) q − x w||², Q_a per-row absmax int8 over `groups` equal column groups (the
  integer path's activation quantization); q the quantized s·w, dequantized."""
  r, k = x_RK.shape
  xs_RGg = (x_RK / s_K).reshape(r, groups, -1)
  step = jnp.max(jnp.abs(xs_RGg), axis=-1, keepdims=True) / 127
  step = jnp.where(step == 0, 1.0, step)
  qx_RK = (jnp.clip(jnp.round(xs_RGg / step), -127, 127) * step).reshape(r, k)
  d_RM = qx_RK @ q_KM - x_RK @ w_KM
  return jnp.sum(d_RM * d_RM)


def search_smoothing(weights, x_RK: np.ndarray, amax_K: np.ndarray, channel_K: np.ndarray,
                     grid: int = 10):
  """(α or None for no smoothing, s per feeding channel) with the least summed
  `_product_error` over `weights`, a list of (w_KM, fmt, path) reading inputs x_RK."""
  c = int(channel_K.max()) + 1
  a_C = np.zeros(c, np.float32)
  np.maximum.at(a_C, channel_K, amax_K)
  w_C = np.zeros(c, np.float32)
  for w, _, _ in weights:
    np.maximum.at(w_C, channel_K, np.abs(w).max(axis=1))
  floor = lambda v: np.maximum(v, max(v.max(), 1e-30) * 1e-4)   # channels never seen
  a_C, w_C = floor(a_C), floor(w_C)
  candidates = [(None, np.ones(c, np.float32))]
  for alpha in np.arange(grid) / grid:
    s_C = a_C ** alpha / w_C ** (1 - alpha)
    candidates.append((float(alpha), (s_C / np.sqrt(s_C.max() * s_C.min())).astype(np.float32)))
  x = jnp.asarray(x_RK)
  errors = []
  for _, s_C in candidates:
    s_K = s_C[channel_K]
    err = 0.0
    for w, fmt, path in weights:
      q_KM = decode(*encode(w * s_K[:, None], fmt, path), fmt)
      err += float(_product_error(x, jnp.asarray(w), jnp.asarray(q_KM), jnp.asarray(s_K),
                                  w.shape[0] // fmt.group_for(w.shape[0])))
    errors.append(err)
  return candidates[int(np.argmin(errors))]   # the first minimum: ties keep no smoothing


def smooth_scale(model, plan: dict, calib_ids_NT, *, grid: int = 10, rows: int = 2048,
                 batch: int = 16) -> dict:
  """Smooths `model`'s float weights in place for the pairs whose projections `plan` ({path:
  format}) multiplies with integer activations; returns {pair: [α per layer, None where
  not smoothed]}. The float model computes what it did, up to rounding."""
  if not model.cfg.plain_llama or model.cfg.num_experts:
    raise ValueError("smoothing folds into Llama-style dense blocks (RMSNorm, SwiGLU, no "
                     f"biases); arch={model.cfg.arch!r}, experts={model.cfg.num_experts}: use "
                     "method='rtn'")
  layer_plan = {p[len("blocks/"):]: f for p, f in plan.items()
                if p.startswith("blocks/") and f.act8}
  pairs = [(feeder, [p for p in after if p in layer_plan]) for feeder, after in PAIRS]
  pairs = [(feeder, after) for feeder, after in pairs if after]
  alphas = {feeder: [] for feeder, _ in pairs}
  if not pairs:
    return alphas
  stacked = params_by_path(model)
  inputs = sorted({after[0] for _, after in pairs})
  calls = -(-len(calib_ids_NT) // batch)
  # Smoothing leaves each block's function as it was: its recording run gives the next inputs.
  walk = BlockHessians(model, inputs, calib_ids_NT, batch, rerun=False,
                       record=input_stats(rows, calls))
  for layer, block, stats in walk:
    local = params_by_path(block)
    for feeder, after in pairs:
      mats = [(to_matrix(np.asarray(local[p][...], np.float32), *axes_of(p)), layer_plan[p], p)
              for p in after]
      channel_K = feeding_channel(feeder, local)
      amax_K, x_RK = stats[after[0]]
      alpha, s_C = search_smoothing(mats, x_RK, amax_K, channel_K, grid)
      alphas[feeder].append(alpha)
      if alpha is not None:
        fold(stacked, layer, feeder, after, s_C, channel_K)
  return alphas


def smooth_quantize(model, rules, calib_ids_NT, *, fit_groups: bool = False, grid: int = 10,
                    rows: int = 2048, batch: int = 16) -> tuple[dict, dict]:
  """`smooth_scale`, then round-to-nearest by `rules`. In place; returns (the plan, the
  α per pair and layer)."""
  plan = quant_plan(model, rules, fit_groups=fit_groups)
  alphas = smooth_scale(model, plan, calib_ids_NT, grid=grid, rows=rows, batch=batch)
  quantize_model(model, rules, fit_groups=fit_groups)
  return plan, alphas
