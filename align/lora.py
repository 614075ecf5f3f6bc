"""LoRA adapters as a merged low-rank delta on the parameter tree.

  W' = W + (alpha / rank) * reshape(a_KR @ b_RM, W.shape)

A frozen base tree `params` (`nnx.state(model, nnx.Param)`) is shared by the
policy, `nnx.merge(graphdef, merge_lora(params, lora, alpha, rank))`, and the
reference, `nnx.merge(graphdef, params)`; only `lora` (a plain dict, so optax and
orbax take it as is) is trained. `nnx.LoRA` does not apply: it wraps an
`nnx.Linear` module, while our weights are einsum tensors (`wq_DNH`, `down_FD`)
read by `models.layers.project`, so the delta is added to the tensors instead.

A weight is viewed as a matrix from the letters after the last "_" of its name: a
projection reads the contraction letters models/quant/rules.py lists for it (`wq_b_QNX`:
K = Q, M = N·X; latent attention's per-head `wk_b_CNH`/`wv_b_CNU` read C); otherwise a
signature starting with D reads D and writes the rest (`wq_DNH`: K = D, M = N·H) and any
other reads all but the last letter and writes the last (`wo_NHD`: K = N·H, M = D). Leading dims beyond the signature (the stacked
`layers` axis) get an adapter each. Local letter key: K the flattened input,
M the flattened output, R the rank, `...` the stacked leading dims.

Quantized base weights (infer/quant) are not arrays and are not supported.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.quant.rules import CONTRACTS
from train.defaults import LORA_TARGETS

__all__ = ["DEFAULT_TARGETS", "init_lora", "merge_lora", "lora_param_count", "lora_shardings"]

DEFAULT_TARGETS = tuple(LORA_TARGETS.split(","))
# Input letters of weights that are not projections of the quantizer's (models/quant/rules.py).
_INPUTS = {**CONTRACTS, "wk_b_CNH": "C", "wv_b_CNU": "C"}


def _is_leaf(x) -> bool:
  return isinstance(x, nnx.Variable)


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path_str(path) -> str:
  return "/".join(_key_str(k) for k in path)


def _value(leaf):
  return leaf[...] if isinstance(leaf, nnx.Variable) else leaf


def _matrix_split(name: str, shape) -> tuple[tuple, int, int]:
  """(lead dims, K, M) of the weight `name` with `shape`, by the rule in the module doc."""
  sig = name.rsplit("_", 1)[-1] if "_" in name else ""
  if len(sig) < 2 or len(sig) > len(shape):
    raise ValueError(f"LoRA target {name!r} with shape {tuple(shape)}: the letters after its "
                     "last '_' must name at least its last two dims")
  n_lead = len(shape) - len(sig)
  n_in = len(_INPUTS[name]) if name in _INPUTS else 1 if sig[0] == "D" else len(sig) - 1
  lead, dims = tuple(shape[:n_lead]), tuple(shape[n_lead:])
  return lead, math.prod(dims[:n_in]), math.prod(dims[n_in:])


def _targets_in(params, targets) -> list[tuple[str, str, jax.Array]]:
  """(path string, param name, value) of every leaf whose name is in `targets`."""
  found = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_leaf):
    if path and _key_str(path[-1]) in targets:
      found.append((_path_str(path), _key_str(path[-1]), _value(leaf)))
  return found


def init_lora(params, rank: int, key, targets=DEFAULT_TARGETS) -> dict:
  """{path: {"a": a_...KR ~ N(0, 1/K), "b": b_...RM = 0}} for each param named in `targets`.

  b = 0 makes the merged model start exactly at the base model.
  """
  if not isinstance(rank, int) or rank < 1:
    raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
  targets = tuple(targets)
  found = _targets_in(params, targets)
  if not found:
    raise ValueError(f"no parameter is named any of the LoRA targets {targets}")
  keys = jax.random.split(key, len(found))
  lora = {}
  for k, (path, name, w) in zip(keys, found):
    lead, k_in, m_out = _matrix_split(name, w.shape)
    a_KR = jax.random.normal(k, (*lead, k_in, rank), jnp.float32) / math.sqrt(k_in)
    lora[path] = {"a": a_KR, "b": jnp.zeros((*lead, rank, m_out), jnp.float32)}
  return lora


def merge_lora(params, lora: dict, alpha: float, rank: int):
  """`params` with each adapted weight replaced by W + (alpha/rank) * a @ b, in W's dtype.

  The sum is taken in float32; leaves without an adapter are returned as the same
  objects. Differentiable in `lora` (close over `params` to keep the base frozen).
  `nnx.merge` reuses a State's Variables, so a model merged from the result shares
  those with `params`: writing into it in place edits the base (use copy=True).
  """
  if isinstance(rank, int) and rank < 1:
    raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
  used = set()
  scale = alpha / rank

  def merge(path, leaf):
    p = _path_str(path)
    if p not in lora:
      return leaf
    used.add(p)
    w = _value(leaf)
    a_KR, b_RM = lora[p]["a"], lora[p]["b"]
    lead, k_in, m_out = _matrix_split(_key_str(path[-1]), w.shape)
    want_a, want_b = (*lead, k_in, a_KR.shape[-1]), (*lead, a_KR.shape[-1], m_out)
    if a_KR.shape != want_a or b_RM.shape != want_b:
      raise ValueError(f"LoRA adapter {p!r}: a {a_KR.shape}, b {b_RM.shape}; the weight "
                       f"{tuple(w.shape)} needs a {want_a}, b {want_b}")
    if isinstance(rank, int) and a_KR.shape[-1] != rank:
      raise ValueError(f"LoRA adapter {p!r} has rank {a_KR.shape[-1]}, merge_lora got {rank}")
    # HIGHEST: the delta lands in the weights, so keep it at full f32 on TPU too.
    delta_KM = jnp.matmul(a_KR.astype(jnp.float32), b_RM.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    merged = (w.astype(jnp.float32) + scale * delta_KM.reshape(w.shape)).astype(w.dtype)
    return leaf.replace(merged) if isinstance(leaf, nnx.Variable) else merged

  out = jax.tree_util.tree_map_with_path(merge, params, is_leaf=_is_leaf)
  unused = sorted(set(lora) - used)
  if unused:  # a stale or misspelt adapter would otherwise be silently dropped
    raise ValueError(f"LoRA adapters match no parameter: {unused}")
  return out


def lora_param_count(lora: dict) -> int:
  """Number of trainable adapter values."""
  return sum(int(x.size) for x in jax.tree.leaves(lora))


def lora_shardings(lora: dict, mesh) -> dict:
  """A replicated NamedSharding for every adapter leaf: they are small next to the base."""
  return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), lora)
