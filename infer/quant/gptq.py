"""GPTQ (Frantar et al., 2022): quantize a weight row by row, pushing each row's error onto
the rows not yet quantized through the inverse Hessian of the layer's inputs.

For a projection y = x·w_KM, the output error over calibration inputs X is
tr((ŵ - w)ᵀ H (ŵ - w)) with H = 2 XᵀX / n. Rows of w_KM are the paper's
"columns" (input features). Blocks of rows get lazy batch updates; each group's
scale is fixed from the error-updated rows when the loop reaches the group.

`gptq_quantize` runs it block by block through the model: the inputs of block
i's projections come from blocks 0..i-1 already quantized (the paper's
sequential order), captured by handing `models.layers.project` a recording
weight. The model's own Block code runs; nothing here copies it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from models.quant.formats import QuantFormat, dequantize_values, quantize_values, scales_for
from models.quant.qarray import to_matrix
from infer.quant.quantize import quantize_model, to_qarray
from models.quant.rules import axes_of, contraction_size, params_by_path, quant_plan


def gptq(w_KM: np.ndarray, h_KK: np.ndarray, fmt: QuantFormat, *, damp: float = 0.01,
         block: int = 128, act_order: bool = False, clip_search: bool = False):
  """(codes_GgM, scale_GM, offset_GM) minimising the H-weighted output error of w_KM.

  `act_order` quantizes rows in order of decreasing H diagonal (the inputs
  with the most energy first, while the most rows remain to absorb their
  error), with every group's scale fixed beforehand from the original rows
  ("static groups"), so groups stay contiguous rows as the storage needs.
  `clip_search` picks each group's range by least squared error
  (formats.scales_for(search=True)) instead of min/max.
  """
  k, m = w_KM.shape
  g = fmt.group_for(k)
  if k % g:
    raise ValueError(f"group {g} does not divide the contraction dimension {k}")
  w = np.array(w_KM, np.float64)
  h = np.array(h_KK, np.float64)
  dead = np.diag(h) == 0
  h[dead, dead] = 1.0   # inputs calibration never saw: plain rounding, no error feedback
  h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
  codes = np.zeros((k, m), np.uint8)
  scales, offsets = np.zeros((k // g, m), np.float32), np.zeros((k // g, m), np.float32)
  order = np.arange(k)
  # Groups longer than a block (per-channel INT8) get their scales up front from the
  # original rows, as GPTQ does per channel, so blocks stay 128 rows.
  static = act_order or g > block
  if static:
    s, o = scales_for(w.reshape(k // g, g, m).astype(np.float32), fmt, clip_search)
    scales[:], offsets[:] = s, 0.0 if o is None else o
  if act_order:
    order = np.argsort(-np.diag(h), kind="stable")
    w, h = w[order], h[order][:, order]
  u = np.linalg.cholesky(np.linalg.inv(h)).T   # upper factor: H⁻¹ = uᵀu
  if not static:
    block = g * max(1, block // g)   # a group's rows all inside one block
  for i1 in range(0, k, block):
    i2 = min(i1 + block, k)
    w1, u1 = w[i1:i2].copy(), u[i1:i2, i1:i2]
    err1 = np.zeros_like(w1)
    for i in range(i2 - i1):
      r = order[i1 + i]   # the row's place in w_KM
      if static:
        scale, offset = scales[r // g], None if fmt.symmetric else offsets[r // g]
      elif r % g == 0:
        s, o = scales_for(w1[i:i + g][None].astype(np.float32), fmt, clip_search)
        scale, offset = s[0], None if o is None else o[0]
        scales[r // g] = scale
        if offset is not None:
          offsets[r // g] = offset
      c = quantize_values(w1[i], scale, offset, fmt)
      codes[r] = c
      err = (w1[i] - dequantize_values(c, scale, offset, fmt)) / u1[i, i]
      w1[i:] -= np.outer(u1[i, i:], err)
      err1[i] = err
    w[i2:] -= u[i1:i2, i2:].T @ err1
  return (codes.reshape(k // g, g, m), scales, None if fmt.symmetric else offsets)


class _Recorder:
  """Stands in for a float weight during calibration: accumulates 2·xᵀx of its inputs."""

  def __init__(self, value, sink: dict, key: str):
    self.value, self.sink, self.key = value, sink, key

  def __getitem__(self, index):
    return self

  def einsum(self, spec, x, dtype, **kwargs):
    memo = self.sink.get("_memo")
    if memo is not None and memo[0] is x:   # q/k/v (and gate/up) share their input
      h_KK = memo[1]
    else:
      x_NK = jnp.reshape(x, (-1, contraction_size(self.key, self.value.shape)))
      x_NK = x_NK.astype(jnp.float32)
      h_KK = np.asarray(2.0 * jnp.matmul(x_NK.T, x_NK, precision=jax.lax.Precision.HIGHEST),
                        np.float64)
      self.sink["_memo"] = (x, h_KK)
    h, n = self.sink.get(self.key, (0.0, 0))
    self.sink[self.key] = (h + h_KK, n + x.size // h_KK.shape[0])
    return jnp.einsum(spec, x, self.value.astype(dtype), **kwargs)


def _hessians(module, paths, run) -> tuple[dict, object]:
  """({path: H_KK} of the inputs each named weight of `module` sees while `run(module)` runs,
  what `run` returned)."""
  variables, sink = params_by_path(module), {}
  originals = {p: variables[p][...] for p in paths}
  for p, value in originals.items():
    variables[p].set_value(_Recorder(value, sink, p))
  try:
    out = run(module)
  finally:
    for p, value in originals.items():
      variables[p].set_value(value)
  sink.pop("_memo", None)
  return {p: h / n for p, (h, n) in sink.items()}, out


class BlockHessians:
  """Iterates (layer, block, {path: H_KK}) over the blocks in order, for `paths` relative to a
  block. Block i's inputs come from blocks 0..i-1 as the consumer left them (quantized, for
  GPTQ's sequential order): after each yield the block runs on the calibration activations.
  With `rerun=False` the consumer promises to leave each block's function unchanged, and the
  recording run's outputs are used instead (half the forward passes). `outputs` holds the
  last block's outputs once the walk is done. `record(block, paths, run)` gathers other
  statistics of the inputs in place of the Hessians (infer/quant/smooth.py)."""

  def __init__(self, model, paths, calib_ids_NT, batch: int = 16, rerun: bool = True,
               record=None):
    ids = np.asarray(calib_ids_NT, np.int32)
    if ids.ndim != 2 or ids.size == 0:
      raise ValueError(f"calibration ids must be a non-empty [N, T] array, got shape {ids.shape}")
    self.model, self.paths, self.rerun = model, list(paths), rerun
    self.record = record or _hessians
    self.pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    self.segs = jnp.ones(ids.shape, jnp.int32)
    self.chunks = [slice(i, i + batch) for i in range(0, len(ids), batch)]
    self.outputs = [model.embed(jnp.asarray(ids[c])) for c in self.chunks]

  def run(self, block):
    return [block(x, self.pos[c], self.segs[c])[0] for x, c in zip(self.outputs, self.chunks)]

  def __iter__(self):
    graphdef, state = nnx.split(self.model.blocks)
    for layer in tqdm.tqdm(range(self.model.cfg.num_layers), desc="calibrating layers",
                           unit="layer", leave=False, disable=None):
      block = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], state))
      hessians, outputs = self.record(block, self.paths, self.run)
      yield layer, block, hessians
      self.outputs = self.run(block) if self.rerun else outputs


def _solve(module, path, fmt, h_KK, options):
  """GPTQ for one weight of `module`; leaves its dequantized values in place and returns
  (codes, scale, offset)."""
  var = params_by_path(module)[path]
  w = np.asarray(var[...], np.float32)
  letters, in_letters = axes_of(path)
  out = gptq(to_matrix(w, letters, in_letters), h_KK, fmt, **options)
  var.set_value(to_qarray(out, fmt, letters, in_letters, w.shape).dequantize())
  return out


def gptq_quantize(model, rules, calib_ids_NT, *, fit_groups: bool = False, damp: float = 0.01,
                  act_order: bool = False, clip_search: bool = False, batch: int = 16) -> dict:
  """Quantizes `model` in place, GPTQ for every projection the rules select; returns the plan.

  `calib_ids_NT` are token ids of real text. The input embedding is quantized
  by round-to-nearest (a lookup has no inputs to calibrate on); a tied
  embedding too, since GPTQ's error feedback, tuned for the logits, would
  distort the lookup table it also is. An untied LM head gets GPTQ.
  """
  if not model.cfg.plain_llama:
    raise ValueError(f"GPTQ calibrates Llama-style decoders (RoPE, causal); arch="
                     f"{model.cfg.arch!r}, position={model.cfg.position!r}: quantize this model "
                     "with method='rtn'")
  plan = quant_plan(model, rules, fit_groups=fit_groups)
  options = dict(damp=damp, act_order=act_order, clip_search=clip_search)
  if "embed_VD" in plan:
    quantize_model(model, [("^embed_VD$", plan["embed_VD"].name)])
  results = {}
  layer_plan = {p[len("blocks/"):]: f for p, f in plan.items() if p.startswith("blocks/")}
  walk = BlockHessians(model, layer_plan, calib_ids_NT, batch)
  for layer, block, hessians in walk:
    for p, fmt in layer_plan.items():
      try:
        results[("blocks/" + p, layer)] = _solve(block, p, fmt, hessians[p], options)
      except np.linalg.LinAlgError as e:
        raise ValueError(f"GPTQ of blocks/{p}, layer {layer}: {e} (raise damp, or calibrate "
                         "on more text)") from e
  xs = walk.outputs   # the last block's outputs, every block's quantization error included
  if "unembed_DV" in plan:
    h = _hessians(model, ["unembed_DV"], lambda m: [m.logits(x) for x in xs])[0]["unembed_DV"]
    results[("unembed_DV", None)] = _solve(model, "unembed_DV", plan["unembed_DV"], h, options)

  rest = [(f"^{p}$", f.name) for p, f in plan.items() if p != "embed_VD"]
  if rest:
    quantize_model(model, rest, method=lambda path, layer, w_KM, fmt: results[(path, layer)])
  return plan
