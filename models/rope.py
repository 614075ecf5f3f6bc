"""Rotary position embeddings and the context-extension schemes of the model families meshlm
loads: each scheme changes only the rotation frequencies (and, for YaRN, scales cos and sin).

  default  theta^(-2i/H)
  linear   default / factor (position interpolation)
  llama3   Llama 3.1's: low frequencies / factor, high ones kept, a smooth ramp between
  yarn     YaRN: per-frequency blend of interpolated and original by a ramp over
           [beta_fast, beta_slow] rotations, cos and sin scaled by 0.1 ln(factor) + 1
  dynamic  dynamic NTK: past original_max_len (the config's max_position_embeddings), the base
           grows with the sequence, theta·(factor·L/orig − factor + 1)^(H/(H−2)), L = a row's
           length so far (its largest real position + 1)
  longrope Phi-3's: per-frequency divisors, short_factors while a row is within
           original_max_len and long_factors past it, cos and sin scaled by
           sqrt(1 + ln(factor) / ln(original_max_len))
  factors  default / freq_factors, one divisor per frequency: what a GGUF file's
           rope_freqs.weight holds (llama.cpp's converter computes Llama 3.1's llama3
           scaling into it); no Hugging Face config.json says this

The frequencies are a function of the config alone, computed once in numpy at trace time,
as transformers' modeling_rope_utils computes them (the parity tests hold it to that); those
of dynamic and longrope depend on the row's length too, computed in the traced step, per row
(transformers takes the batch's longest: the same for one row, as the parity tests run).
A cached key keeps the rotation it was written with, as in transformers' generation.
`RopeScaling` is the part of ModelConfig that names the scheme.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "factors")
BY_LENGTH = ("dynamic", "longrope")  # frequencies that depend on a row's length


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A context-extension scheme and its parameters (transformers' rope_parameters names)."""
  kind: str = "default"
  factor: float = 1.0
  original_max_len: int = 0          # llama3, yarn: the pretraining context
  low_freq_factor: float = 1.0       # llama3
  high_freq_factor: float = 4.0      # llama3
  beta_fast: float = 32.0            # yarn
  beta_slow: float = 1.0             # yarn
  attention_factor: float = 0.0      # yarn: cos/sin scale; 0 derives it from factor
  truncate: bool = True              # yarn: round the ramp's ends to whole dimensions
  freq_factors: tuple = ()           # factors: a divisor per frequency (head_dim / 2 of them)
  short_factors: tuple = ()          # longrope: divisors within original_max_len
  long_factors: tuple = ()           # longrope: divisors past it

  def check(self) -> str | None:
    """What is wrong with these parameters, or None."""
    if self.kind not in SCHEMES:
      return f"rope scaling {self.kind!r}; choose one of {SCHEMES}"
    if self.kind != "default" and not self.factor > 0:
      return f"rope scaling {self.kind!r} needs factor > 0, got {self.factor}"
    if self.kind in ("llama3", "yarn", "dynamic", "longrope") and self.original_max_len <= 0:
      return f"rope scaling {self.kind!r} needs original_max_len > 0"
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      return "llama3 rope scaling needs high_freq_factor > low_freq_factor"
    if (self.kind == "factors") != bool(self.freq_factors):
      return "rope scaling 'factors' and freq_factors (rope_freq_factors) go together"
    if self.freq_factors and not all(f > 0 for f in self.freq_factors):
      return "rope freq_factors must all be > 0"
    if (self.kind == "longrope") != bool(self.short_factors and self.long_factors):
      return "rope scaling 'longrope' and short_factors / long_factors go together"
    if len(self.short_factors) != len(self.long_factors) or not all(
        f > 0 for f in self.short_factors + self.long_factors):
      return "longrope short_factors and long_factors must be as long and all > 0"
    return None


def frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
  """(inverse frequencies [head_dim / 2] as float32, the cos/sin scale)."""
  dim = head_dim
  inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
  kind = scaling.kind
  if kind in BY_LENGTH:
    raise ValueError(f"rope scaling {kind!r} depends on the row's length: `by_length`")
  if kind == "default":
    return inv_freq.astype(np.float32), 1.0
  if kind == "linear":
    return (inv_freq / scaling.factor).astype(np.float32), 1.0
  if kind == "factors":
    if len(scaling.freq_factors) != dim // 2:
      raise ValueError(f"rope freq_factors has {len(scaling.freq_factors)} entries; a "
                       f"{dim}-wide rotation has {dim // 2} frequencies")
    return (inv_freq / np.asarray(scaling.freq_factors, np.float32)).astype(np.float32), 1.0
  if kind == "llama3":
    factor, old = scaling.factor, scaling.original_max_len
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = ((old / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  return _yarn(dim, theta, scaling)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
  """YaRN's mscale, 0.1·m·ln(factor) + 1 (1 for factor <= 1): its default cos/sin factor, and
  squared with DeepSeek's mscale_all_dim, its softmax scale."""
  return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
  factor = s.factor
  attention = s.attention_factor or yarn_mscale(factor)

  def correction_dim(rotations):
    return dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  pos_freqs = theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)
  extrapolation = 1.0 / pos_freqs
  interpolation = 1.0 / (factor * pos_freqs)
  keep = 1 - ramp  # the share of the original (extrapolated) frequency
  inv_freq = interpolation * (1 - keep) + extrapolation * keep
  return inv_freq.astype(np.float32), float(attention)


def by_length(dim: int, theta: float, s: RopeScaling, length_B) -> tuple[jax.Array, float]:
  """(inverse frequencies [B, dim / 2], the cos/sin scale) of the length-dependent schemes
  for rows of `length_B` tokens (traced), as transformers' dynamic / longrope updates."""
  exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  length_B1 = length_B.astype(jnp.float32)[:, None]
  old = s.original_max_len
  if s.kind == "dynamic":
    length_B1 = jnp.maximum(length_B1, old)
    base_B1 = theta * ((s.factor * length_B1 / old) - (s.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base_B1 ** exponent, 1.0
  factors = (jnp.asarray(s.short_factors, jnp.float32), jnp.asarray(s.long_factors, jnp.float32))
  ext_BH = jnp.where(length_B1 > old, factors[1], factors[0])
  scale = s.attention_factor or (
      1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(old)))
  return 1.0 / (ext_BH * jnp.float32(theta) ** exponent), scale


def row_lengths(positions_BT, segment_ids_BT=None):
  """Each row's length so far: its largest real position + 1 (segment id 0: padding)."""
  if segment_ids_BT is not None:
    positions_BT = jnp.where(segment_ids_BT > 0, positions_BT, -1)
  return jnp.max(positions_BT, axis=-1) + 1


def apply(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float,
          scaling: RopeScaling = RopeScaling(), interleaved: bool = False,
          length_B=None) -> jax.Array:
  """Rotary embedding, half-split ("rotate_half") layout as in Hugging Face Llama, or with
  `interleaved` pairs (x0, x1), (x2, x3), ... each rotated by one frequency (DeepSeek's).
  `length_B`: the rows' lengths for the length-dependent schemes (default: row_lengths)."""
  h = x_BTNH.shape[-1]
  if scaling.kind in BY_LENGTH:
    length_B = row_lengths(positions_BT) if length_B is None else length_B
    inv_freq_BH, scale = by_length(h, theta, scaling, length_B)
    angle_BTH2 = positions_BT[..., None].astype(jnp.float32) * inv_freq_BH[:, None, :]
  else:
    if scaling.kind == "default":  # computed in JAX as always: the parity goldens stay bitwise
      inv_freq, scale = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h), 1.0
    else:
      inv_freq, scale = frequencies(h, theta, scaling)
    angle_BTH2 = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  sin, cos = jnp.sin(angle_BTH2)[:, :, None, :], jnp.cos(angle_BTH2)[:, :, None, :]
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  x = x_BTNH.astype(jnp.float32)
  if interleaved:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    return out.astype(x_BTNH.dtype)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


# transformers' rope_parameters keys -> ModelConfig's rope_* fields.
_HF_FIELDS = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_len",
              "low_freq_factor": "rope_low_freq_factor",
              "high_freq_factor": "rope_high_freq_factor", "beta_fast": "rope_beta_fast",
              "beta_slow": "rope_beta_slow", "attention_factor": "rope_attention_factor"}
# Keys a scheme may carry that change nothing here (transformers' own bookkeeping).
_HF_IGNORED = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "short_factor",
               "long_factor"}


def merge_hf(parameters: dict, scaling: dict, source: str) -> dict:
  """One scheme from transformers 5's rope_parameters and 4's rope_scaling, which a config
  may both carry: the one that is not plain RoPE; ValueError where they name two."""
  def kind(d):
    return d.get("rope_type", d.get("type")) or "default"
  if kind(scaling) == "default":
    return parameters
  if kind(parameters) not in ("default", kind(scaling)):
    raise ValueError(f"{source}: rope_parameters ({kind(parameters)!r}) and rope_scaling "
                     f"({kind(scaling)!r}) name different schemes")
  return {**parameters, **scaling}


def from_hf(params: dict, source: str, max_position_embeddings: int | None) -> dict:
  """ModelConfig rope_* fields from a config.json's rope_parameters / rope_scaling dict;
  ValueError naming what cannot be run exactly."""
  kind = params.get("rope_type", params.get("type")) or "default"
  if kind not in SCHEMES or kind == "factors":  # factors: a GGUF file's, not a config.json's
    raise ValueError(f"{source}: rope scaling type {kind!r} is not supported; only "
                     f"{', '.join(SCHEMES[:-1])}")
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{source}: partial_rotary_factor={params['partial_rotary_factor']} is "
                     "not supported (every head dimension rotates)")
  if kind == "default":
    return {"rope_scaling": "default"}
  unknown = sorted(set(params) - set(_HF_FIELDS) - _HF_IGNORED - {"truncate"})
  if unknown:  # e.g. YaRN's mscale / mscale_all_dim (DeepSeek): not modelled here
    raise ValueError(f"{source}: rope scaling {kind!r} with {unknown} is not supported")
  if params.get("truncate", True) is not True:
    raise ValueError(f"{source}: yarn truncate=false is not supported")
  out = {"rope_scaling": kind}
  out.update({field: params[key] for key, field in _HF_FIELDS.items()
              if params.get(key) is not None})
  if kind == "dynamic":  # transformers grows the base past max_position_embeddings itself
    out["rope_original_max_len"] = max_position_embeddings
  if kind == "longrope":
    out["rope_short_factors"] = tuple(params.get("short_factor") or ())
    out["rope_long_factors"] = tuple(params.get("long_factor") or ())
    if "rope_factor" not in out and max_position_embeddings and out.get("rope_original_max_len"):
      out["rope_factor"] = max_position_embeddings / out["rope_original_max_len"]
  if kind == "yarn" and "rope_original_max_len" not in out and max_position_embeddings:
    out["rope_original_max_len"] = max_position_embeddings  # transformers' fallback
  if kind == "yarn" and "rope_factor" not in out:
    out["rope_factor"] = max_position_embeddings / out["rope_original_max_len"]
  return out


def to_hf(scaling: RopeScaling, theta: float) -> dict:
  """rope_parameters for a config.json (transformers 5; 4 reads it as rope_scaling)."""
  if scaling.kind == "factors":
    raise ValueError("rope scaling 'factors' (per-frequency divisors from a GGUF file's "
                     "rope_freqs.weight) has no Hugging Face config.json form: cannot export")
  out = {"rope_type": scaling.kind, "rope_theta": theta}
  if scaling.kind == "default":
    return out
  out["factor"] = scaling.factor
  if scaling.kind == "llama3":
    out.update(low_freq_factor=scaling.low_freq_factor,
               high_freq_factor=scaling.high_freq_factor,
               original_max_position_embeddings=scaling.original_max_len)
  elif scaling.kind == "longrope":
    out.update(short_factor=list(scaling.short_factors), long_factor=list(scaling.long_factors),
               original_max_position_embeddings=scaling.original_max_len)
    if scaling.attention_factor:
      out["attention_factor"] = scaling.attention_factor
  elif scaling.kind == "yarn":
    out.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
               original_max_position_embeddings=scaling.original_max_len)
    if scaling.attention_factor:
      out["attention_factor"] = scaling.attention_factor
  return out
