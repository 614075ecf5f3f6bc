"""Running routed tokens through experts: the dropless and capacity paths, with or without EP.

Both paths take the router's choice, expert_BTO (int) and weight_BTO, and
return out_BTD = sum over choices o of weight_BTO * expert_{expert_BTO}(x_BTD).
Letters (docs/architecture.md): E experts (on one device, in a shard_map), O
choices per token, C capacity slots, A assignments ((token, choice) pairs), X
rows of a grouped matmul, J expert-parallel shards, U tiles of Q rows.

* Dropless: every assignment is computed. Assignments are sorted by expert and
  run as a grouped matmul, `jax.lax.ragged_dot` or (on CPU, where XLA lowers
  ragged_dot to a dense masked product costing E times the FLOPs) a tiled one:
  each expert's rows padded to whole tiles, one batched matmul over tiles with
  each tile's expert weights gathered (in chunks when they would be large).
* Capacity (GShard): each sequence gives expert e at most C slots; choices are
  served first choices first, in token order, and the rest are dropped.

With expert parallelism (`ep_axes` set, inside shard_map) each device holds
E/J experts and exchanges tokens with all-to-all over `ep_axes`.
"""

import math

import jax
import jax.numpy as jnp


# Tiles whose gathered expert weights exceed this are run in chunks (lax.map), so the
# tiled path's extra memory stays bounded for large experts.
_TILE_WEIGHT_BYTES = 256 * 2 ** 20


def _swiglu_grouped(x_XD, group_sizes_E, w, impl: str, tile: int):
  """Rows sorted by group -> SwiGLU of each row's group; rows past sum(group_sizes) give 0."""
  gate_EDF, up_EDF, down_EFD = w
  if impl == "ragged_dot":
    mm = lambda a, b: jax.lax.ragged_dot(a, b.astype(a.dtype), group_sizes_E)
    return mm(jax.nn.silu(mm(x_XD, gate_EDF)) * mm(x_XD, up_EDF), down_EFD)
  # Tiled: group e's rows move to whole tiles starting at its padded offset.
  x, d = x_XD.shape
  e = group_sizes_E.shape[0]
  u = x // tile + e  # enough tiles for any split of x rows into e groups
  padded_E = -(-group_sizes_E // tile) * tile
  pend_E = jnp.cumsum(padded_E)
  start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  group_X = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(x), side="right")
  valid_X = group_X < e
  group_X = jnp.minimum(group_X, e - 1)
  dest_X = jnp.where(valid_X, jnp.arange(x) - start_E[group_X] + pend_E[group_X]
                     - padded_E[group_X], u * tile)
  buf_UQD = jnp.zeros((u * tile, d), x_XD.dtype).at[dest_X].set(x_XD, mode="drop")
  buf_UQD = buf_UQD.reshape(u, tile, d)
  tile_group_U = jnp.minimum(jnp.searchsorted(pend_E, jnp.arange(u) * tile, side="right"), e - 1)

  def tiles(buf_UQD, group_U):
    pick = lambda w_E: w_E[group_U].astype(x_XD.dtype)
    h_UQF = (jax.nn.silu(jnp.einsum("UQD,UDF->UQF", buf_UQD, pick(gate_EDF)))
             * jnp.einsum("UQD,UDF->UQF", buf_UQD, pick(up_EDF)))
    return jnp.einsum("UQF,UFD->UQD", h_UQF, pick(down_EFD))

  per_tile = sum(v[0].size for v in w) * jnp.dtype(x_XD.dtype).itemsize
  chunk = max(1, _TILE_WEIGHT_BYTES // per_tile)
  if chunk >= u:
    y_UQD = tiles(buf_UQD, tile_group_U)
  else:
    y_UQD = jax.lax.map(lambda a: tiles(a[0][None], a[1][None])[0], (buf_UQD, tile_group_U),
                        batch_size=chunk)
  return y_UQD.reshape(u * tile, d).at[dest_X].get(mode="fill", fill_value=0)


def tile_size(rows: int, groups: int) -> int:
  """A power of two near a quarter of the mean group size, within [8, 256]."""
  target = max(rows // (4 * groups), 1)
  return int(min(256, max(8, 2 ** int(math.log2(target)))))


def grouped_swiglu(x_XD, src_A, group_A, valid_A, w, impl: str):
  """y_AD[a] = SwiGLU_{group_A[a]}(x_XD[src_A[a]]), 0 where not valid_A; groups = w's E axis."""
  e = w[0].shape[0]
  key_A = jnp.where(valid_A, group_A, e)  # invalid rows sort last, outside every group
  order_A = jnp.argsort(key_A, stable=True)
  sizes_E = jnp.zeros((e + 1,), jnp.int32).at[key_A].add(1)[:e]
  rows = src_A.shape[0]
  y_AD = _swiglu_grouped(x_XD[src_A[order_A]], sizes_E, w, impl, tile_size(rows, e))
  return jnp.zeros_like(y_AD).at[order_A].set(y_AD)


def _combine(y_AD, weight_BTO, shape_BTD):
  b, t, k = weight_BTO.shape
  y_BTOD = y_AD.reshape(b, t, k, -1)
  return jnp.einsum("BTOD,BTO->BTD", y_BTOD, weight_BTO.astype(y_AD.dtype)).reshape(shape_BTD)


def dropless(x_BTD, expert_BTO, weight_BTO, w, impl: str, ep_axes=None):
  """Every assignment computed; returns out_BTD."""
  b, t, d = x_BTD.shape
  k = expert_BTO.shape[-1]
  x_TD = x_BTD.reshape(b * t, d)
  e_A = expert_BTO.reshape(-1)
  a = e_A.shape[0]
  src_A = jnp.arange(a) // k
  if ep_axes is None:
    y_AD = grouped_swiglu(x_TD, src_A, e_A, jnp.ones((a,), bool), w, impl)
    return _combine(y_AD, weight_BTO, x_BTD.shape)

  # Expert parallel: send each assignment to the shard holding its expert. A
  # shard may receive all A of a device's rows, so each send slot holds A rows.
  j = jax.lax.axis_size(ep_axes)
  e_loc = w[0].shape[0]
  shard_A = e_A // e_loc
  order_A = jnp.argsort(shard_A, stable=True)
  shard_sorted_A = shard_A[order_A]
  counts_J = jnp.zeros((j,), jnp.int32).at[shard_A].add(1)
  slot_A = jnp.arange(a) - (jnp.cumsum(counts_J) - counts_J)[shard_sorted_A]
  send_JAD = jnp.zeros((j, a, d), x_TD.dtype).at[shard_sorted_A, slot_A].set(
      x_TD[src_A[order_A]])
  send_e_JA = jnp.full((j, a), e_loc, jnp.int32).at[shard_sorted_A, slot_A].set(
      (e_A % e_loc)[order_A])
  exchange = lambda z: jax.lax.all_to_all(z, ep_axes, 0, 0, tiled=True)
  recv_XD = exchange(send_JAD).reshape(j * a, d)
  recv_e_X = exchange(send_e_JA).reshape(j * a)
  y_XD = grouped_swiglu(recv_XD, jnp.arange(j * a), recv_e_X, recv_e_X < e_loc, w, impl)
  back_JAD = exchange(y_XD.reshape(j, a, d))
  y_sorted_AD = back_JAD[shard_sorted_A, slot_A]
  y_AD = jnp.zeros_like(y_sorted_AD).at[order_A].set(y_sorted_AD)
  return _combine(y_AD, weight_BTO, x_BTD.shape)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
  """Slots per expert per sequence: ceil(ceil(tokens*k/E) * factor)."""
  return max(1, math.ceil(math.ceil(tokens * k / num_experts) * factor))


def capacity_dispatch(x_BTD, expert_BTO, weight_BTO, w, num_experts: int, factor: float,
                      ep_axes=None, mask_BT=None):
  """GShard dispatch/combine; returns (out_BTD, dropped_BTO).

  Padding (mask_BT False) takes no slot and gets no expert output; C is sized
  from the padded length T (shapes are static), so it is an upper bound.
  """
  b, t, _ = x_BTD.shape
  k = expert_BTO.shape[-1]
  c = capacity(t, k, num_experts, factor)
  real_BT = jnp.ones((b, t), bool) if mask_BT is None else mask_BT
  # Slot of each choice in its expert's queue: first choices of all tokens, then second ...
  onehot_BOTE = (jax.nn.one_hot(jnp.swapaxes(expert_BTO, 1, 2), num_experts, dtype=jnp.int32)
                 * real_BT[:, None, :, None])
  queue_BAE = jnp.cumsum(onehot_BOTE.reshape(b, k * t, num_experts), axis=1) - 1
  slot_BTO = jnp.swapaxes(jnp.sum(queue_BAE.reshape(b, k, t, num_experts) * onehot_BOTE, -1), 1, 2)
  kept_BTO = (slot_BTO < c) & real_BT[..., None]
  onehot_BTOE = jax.nn.one_hot(expert_BTO, num_experts, dtype=x_BTD.dtype)
  slot_BTOC = jax.nn.one_hot(jnp.where(kept_BTO, slot_BTO, c), c, dtype=x_BTD.dtype)
  dispatch_BTEC = jnp.einsum("BTOE,BTOC->BTEC", onehot_BTOE, slot_BTOC)
  combine_BTEC = jnp.einsum("BTOE,BTOC,BTO->BTEC", onehot_BTOE, slot_BTOC,
                            weight_BTO.astype(x_BTD.dtype))
  x_BECD = jnp.einsum("BTEC,BTD->BECD", dispatch_BTEC, x_BTD)
  gate_EDF, up_EDF, down_EFD = (v.astype(x_BTD.dtype) for v in w)
  if ep_axes is not None:
    # [B, E, C, D] -> every shard gets its E_loc experts' slots from all J shards.
    j = jax.lax.axis_size(ep_axes)
    e_loc = gate_EDF.shape[0]
    x_JBECD = jnp.moveaxis(x_BECD.reshape(b, j, e_loc, c, -1), 1, 0)
    x_BECD = jax.lax.all_to_all(x_JBECD, ep_axes, 0, 0, tiled=True).reshape(j * b, e_loc, c, -1)
  h_BECF = (jax.nn.silu(jnp.einsum("BECD,EDF->BECF", x_BECD, gate_EDF))
            * jnp.einsum("BECD,EDF->BECF", x_BECD, up_EDF))
  y_BECD = jnp.einsum("BECF,EFD->BECD", h_BECF, down_EFD)
  if ep_axes is not None:
    y_JBECD = jax.lax.all_to_all(y_BECD.reshape(j, b, e_loc, c, -1), ep_axes, 0, 0, tiled=True)
    y_BECD = jnp.moveaxis(y_JBECD, 0, 1).reshape(b, num_experts, c, -1)
  out_BTD = jnp.einsum("BTEC,BECD->BTD", combine_BTEC, y_BECD)
  return out_BTD, ~kept_BTO & real_BT[..., None]
