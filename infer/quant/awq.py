"""Activation-aware weight scaling (AWQ, Lin et al., 2023) before quantization.

A few input channels of each projection carry most of the activation energy;
their weights matter most. AWQ multiplies those rows of the weight by s > 1
and divides the op that feeds them by s, leaving the float model's outputs
unchanged (up to rounding) while the quantizer sees the salient weights larger,
so their relative rounding error shrinks. Per block, the foldable pairs are:

    attn_norm scale ÷ s  ->  wq, wk, wv rows × s      (input channel D)
    wv columns ÷ s       ->  wo rows × s              (channel K·H; query head n reads kv head n // G)
    mlp_norm scale ÷ s   ->  gate, up rows × s        (D)
    up columns ÷ s       ->  down rows × s            (F; silu(gate)·up is linear in up)

s = a^α per channel, a the calibration inputs' RMS, normalised so that
max(s)·min(s) = 1; α ∈ {0, 1/n, ..., (n-1)/n} (α = 0 is plain rounding) is
chosen per pair and layer to minimise the output error of round-to-nearest,
tr(ΔWᵀ H ΔW) with ΔW = Q(s·W)/s − W and H = 2XᵀX/n the inputs' second moment,
summed over the projections that share the input. The error is taken on each
projection's output, not the block's (AWQ's own search runs the block).

The scaled float model is then quantized by round-to-nearest, each group's
range clipped to the least output error as AWQ does (see awq_quantize), or by
GPTQ.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.quant.formats import QuantFormat
from infer.quant.gptq import BlockHessians, gptq_quantize
from models.quant.qarray import to_matrix
from infer.quant.quantize import encode, quantize_model
from models.quant.rules import axes_of, params_by_path, quant_plan

# (the op whose output channels feed the projections, the projections it feeds)
PAIRS = (("attn_norm/scale", ("attn/wq_DNH", "attn/wk_DKH", "attn/wv_DKH")),
         ("attn/wv_DKH", ("attn/wo_NHD",)),
         ("mlp_norm/scale", ("mlp/gate_DF", "mlp/up_DF")),
         ("mlp/up_DF", ("mlp/down_FD",)))


@functools.partial(jax.jit, static_argnames=("fmt",))
def rtn_errors(w_KM, h_KK, s_AK, fmt: QuantFormat):
  """[A] output errors tr(ΔWᵀ H ΔW) of round-to-nearest after scaling w's rows by each s_K,
  ΔW = Q(s·w)/s − w. Q follows formats.scales_for without its float16 rounding of the
  scales (under 0.05% of a step): a search proxy, jitted since it runs A times per weight."""
  k, m = w_KM.shape
  g = fmt.group_for(k)

  def one(s_K):
    x_GgM = (w_KM * s_K[:, None]).reshape(k // g, g, m)
    if fmt.symmetric and fmt.bits == 8:
      scale = jnp.abs(x_GgM).max(axis=1, keepdims=True) / 127
      lo, hi, offset = -127, 127, 0.0
    elif fmt.symmetric:   # the group's extreme maps to code -8 (formats.scales_for)
      ext = jnp.take_along_axis(x_GgM, jnp.abs(x_GgM).argmax(axis=1)[:, None], axis=1)
      scale, lo, hi, offset = -ext / 8, -8, 7, 0.0
    elif fmt.int_zero:   # the range widened to 0, the offset a whole number of steps
      x_lo = jnp.minimum(x_GgM.min(axis=1, keepdims=True), 0)
      x_hi = jnp.maximum(x_GgM.max(axis=1, keepdims=True), 0)
      scale, lo, hi = (x_hi - x_lo) / (fmt.levels - 1), 0, fmt.levels - 1
      offset = -jnp.clip(jnp.rint(-x_lo / jnp.where(scale == 0, 1.0, scale)), lo, hi) * scale
    else:
      offset = x_GgM.min(axis=1, keepdims=True)
      scale, lo, hi = (x_GgM.max(axis=1, keepdims=True) - offset) / (fmt.levels - 1), 0, \
          fmt.levels - 1
    scale = jnp.where(scale == 0, 1.0, scale)
    q_GgM = jnp.clip(jnp.rint((x_GgM - offset) / scale), lo, hi) * scale + offset
    d_KM = q_GgM.reshape(k, m) / s_K[:, None] - w_KM
    return jnp.sum(d_KM * (h_KK @ d_KM))

  return jax.lax.map(one, s_AK)


def search_scales(weights, h_KK: np.ndarray, channel_K: np.ndarray, grid: int = 20):
  """(α, s per feeding channel) minimising the summed `rtn_errors` of `weights`, a list of
  (w_KM, fmt) sharing inputs with second moment h_KK. Input row k is fed by channel
  channel_K[k]; rows fed by one channel share its scale."""
  rms_K = np.sqrt(np.maximum(np.diag(h_KK) / 2.0, 0.0))
  a_C = np.bincount(channel_K, weights=rms_K) / np.maximum(np.bincount(channel_K), 1)
  a_C = np.maximum(a_C, max(a_C.max(), 1e-30) * 1e-4)   # channels calibration never saw
  alphas = np.arange(grid) / grid
  s_AC = a_C[None, :] ** alphas[:, None]
  s_AC /= np.sqrt(s_AC.max(axis=1, keepdims=True) * s_AC.min(axis=1, keepdims=True))
  s_AK = jnp.asarray(s_AC[:, channel_K], jnp.float32)
  h = jnp.asarray(h_KK, jnp.float32)
  err_A = sum(np.asarray(rtn_errors(jnp.asarray(w), h, s_AK, fmt), np.float64)
              for w, fmt in weights)
  best = int(np.argmin(err_A))   # the first minimum: ties keep the smaller α
  return float(alphas[best]), s_AC[best]


def awq_scale(model, plan: dict, calib_ids_NT, *, grid: int = 20, batch: int = 16) -> dict:
  """Rescales `model`'s float weights in place for quantization by `plan` ({path: format});
  returns {pair: [α per layer]}. Pairs none of whose projections the plan quantizes stay."""
  if not model.cfg.plain_llama or model.cfg.num_experts:
    raise ValueError("AWQ scaling folds into Llama-style dense blocks (RMSNorm, SwiGLU, no "
                     f"biases); arch={model.cfg.arch!r}, experts={model.cfg.num_experts}: use "
                     "method='rtn' or 'gptq'")
  layer_plan = {p[len("blocks/"):]: f for p, f in plan.items() if p.startswith("blocks/")}
  pairs = [(feeder, [p for p in after if p in layer_plan]) for feeder, after in PAIRS]
  pairs = [(feeder, after) for feeder, after in pairs if after]
  stacked = params_by_path(model)
  alphas = {feeder: [] for feeder, _ in pairs}
  inputs = sorted({after[0] for _, after in pairs})
  # Scaling leaves each block's function as it was: its recording run gives the next inputs.
  for layer, block, hessians in BlockHessians(model, inputs, calib_ids_NT, batch, rerun=False):
    local = params_by_path(block)
    for feeder, after in pairs:
      mats = []
      for p in after:
        w = np.asarray(local[p][...], np.float32)
        mats.append((to_matrix(w, *axes_of(p)), layer_plan[p]))
      channel_K = feeding_channel(feeder, local)
      alpha, s_C = search_scales(mats, hessians[after[0]], channel_K, grid)
      alphas[feeder].append(alpha)
      if alpha:
        fold(stacked, layer, feeder, after, s_C.astype(np.float32), channel_K)
  return alphas


def feeding_channel(feeder: str, local) -> np.ndarray:
  """Row k of the fed projections' contraction reads channel [k] of the feeder's output."""
  if feeder == "attn/wv_DKH":
    n, h = local["attn/wo_NHD"][...].shape[:2]
    kv = local[feeder][...].shape[1]
    head = np.arange(n) // (n // kv)
    return (head[:, None] * h + np.arange(h)[None, :]).reshape(-1)
  return np.arange(local[feeder][...].shape[-1])


def fold(stacked, layer: int, feeder: str, after, s_C: np.ndarray, channel_K: np.ndarray):
  """Feeder's output channels (its trailing axes) ÷ s and the projections' contraction rows
  (their leading axes) × s of the channel they read, in layer `layer` of the model's stacked
  block parameters."""
  def update(path, fn):
    var = stacked["blocks/" + path]
    value = np.array(var[...], np.float32)
    value[layer] = fn(value[layer])
    var.set_value(jnp.asarray(value, var[...].dtype))

  update(feeder, lambda w: w / s_C.reshape(w.shape[1:] if w.ndim > 1 else w.shape))
  s_K = s_C[channel_K]
  for p in after:
    k_axes = len(axes_of(p)[1])
    update(p, lambda w, n=k_axes: w * s_K.reshape(w.shape[:n] + (1,) * (w.ndim - n)))


def awq_quantize(model, rules, calib_ids_NT, *, fit_groups: bool = False, gptq: bool = False,
                 clip_search: bool = True, act_order: bool = True, grid: int = 20,
                 batch: int = 16) -> tuple[dict, dict]:
  """AWQ scaling, then round-to-nearest or, with `gptq=True`, GPTQ (`act_order`) on the
  scaled model. In place; returns (the plan, {pair: [α per layer]}).

  `clip_search` clips each group's range to the least output error, weighted by the
  scaled inputs' second moment (AWQ's clipping search, on each projection's outputs).
  Unweighted, it clipped the rows the scaling had just enlarged for their energy (on
  SmolLM2 at int4-g128 perplexity rose from 16.05 to 17.24; docs/notes/quantization.md)."""
  plan = quant_plan(model, rules, fit_groups=fit_groups)
  alphas = awq_scale(model, plan, calib_ids_NT, grid=grid, batch=batch)
  if gptq:
    gptq_quantize(model, rules, calib_ids_NT, fit_groups=fit_groups, act_order=act_order,
                  clip_search=clip_search, batch=batch)
    return plan, alphas
  codes = {}
  if clip_search:
    # The scaled inputs' second moments: the walk over the scaled model, whose blocks
    # compute what they did, so one recording run per block.
    layer_plan = {p[len("blocks/"):]: f for p, f in plan.items() if p.startswith("blocks/")}
    walk = BlockHessians(model, layer_plan, calib_ids_NT, batch, rerun=False)
    for layer, block, hessians in walk:
      local = params_by_path(block)
      for p, fmt in layer_plan.items():
        w_KM = to_matrix(np.asarray(local[p][...], np.float32), *axes_of(p))
        codes[("blocks/" + p, layer)] = encode(w_KM, fmt, p, hessians[p])
  quantize_model(model, rules, fit_groups=fit_groups,
                 method=lambda path, layer, w_KM, fmt: codes.get((path, layer))
                 or encode(w_KM, fmt, path))
  return plan, alphas
