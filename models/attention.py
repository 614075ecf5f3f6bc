"""Scaled dot-product attention with grouped-query heads: one entry point, several kernels.

`attention(q_BTNH, k_BSKH, v_BSKH, ...)` serves training (T = S), prefill and
decode (T = 1 query against S cached keys). Key j is visible to query i iff

  * kv_segment_ids[j] != 0 (0 marks padding and empty cache slots), and
    q_segment_ids[i] == kv_segment_ids[j] when query segment ids are given;
  * causal: kv_pos[j] <= q_pos[i], or key j is in the row's bidirectional
    prefix (kv_prefix[j], prefix-LM: the prompt sees itself both ways);
  * sliding_window W (needs causal): q_pos[i] - W < kv_pos[j]. W may be a traced scalar
    (a layer's own window inside a layer scan: Gemma's local/global layers).

`visible(...)` is this rule's one definition (infer/ragged.py masks with it too).

Positions default to indices (query i at i, key j at j); pass them when the
queries are not the first T keys, as in decode. A query with no visible key
gets a zero output (and zero gradients), never NaN. `bias_fn(q_pos_BT,
kv_pos_BS) -> bias [B|1, N, T, S]` adds a float32 bias to the scores (T5's
relative positions); it runs on the naive kernel, as do a traced window and
`softcap` c > 0 (Gemma 2: scores -> c·tanh(scores / c) before the mask).

Implementations (`impl`):

  naive      the reference: scores [B, K, G, T, S] and softmax in float32.
  blockwise  pure-JAX flash attention: queries in blocks of `block_q`, an
             online softmax over key blocks of `block_kv`, and a custom VJP
             that recomputes each block from the saved output and logsumexp,
             so memory is O(T + S) plus one [block_q, block_kv] tile per head.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")` (GPU).
  pallas     Pallas splash attention (TPU).
  auto       cudnn on GPU, pallas on TPU; elsewhere (and where those cannot
             express the request) naive while T·S < AUTO_NAIVE_MAX_SCORES,
             blockwise beyond: small problems run faster as one fused matmul,
             large ones need the O(n) memory.

cudnn and pallas run self-attention only (T = S, no explicit positions, query
and key segment ids the same array); anything else falls back, with the reason
logged once.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

import parallel
from models.config import ATTENTION_IMPLS as IMPLS
from parallel import shard_map_logical

# T·S at which "auto" leaves naive: 2^20 scores per head (4 MiB of float32), e.g. T = S = 1024.
# On 2 CPU cores (causal forward+backward, N=8, K=2, H=64) the two tie at T = 512 and
# blockwise, which skips tiles above the diagonal, is 1.8x faster at 1024, 2.5x at 2048.
AUTO_NAIVE_MAX_SCORES = 1 << 20

_log = logging.getLogger(__name__)
_reported = set()


def attention(q_BTNH, k_BSKH, v_BSKH, *, q_segment_ids_BT=None, kv_segment_ids_BS=None,
              q_positions_BT=None, kv_positions_BS=None, causal=True, sliding_window=None,
              impl="auto", block_q=512, block_kv=512, scale=None, kv_prefix_BS=None,
              bias_fn=None, softcap=0.0, value_dims=0):
  """softmax(q·kᵀ·scale + mask)·v per head -> out_BTNH; query head n reads kv head n // (N/K).

  `scale` defaults to H^-0.5; `block_q`/`block_kv` size the blockwise (and Pallas) tiles.
  Values may be narrower or wider than keys (latent attention); `value_dims` > 0: the values
  are the keys' first `value_dims` features and v_BSKH is not read (a latent cache stores
  none).
  """
  b, t, n, h = q_BTNH.shape
  s, k = k_BSKH.shape[1], k_BSKH.shape[2]
  if value_dims:
    v_BSKH = k_BSKH[..., :value_dims]
  if k_BSKH.shape != (b, s, k, h) or v_BSKH.shape[:3] != (b, s, k) or n % k:
    raise ValueError(f"attention shapes q {q_BTNH.shape}, k {k_BSKH.shape}, v {v_BSKH.shape}: "
                     "want q [B,T,N,H], k [B,S,K,H], v [B,S,K,H'] with K dividing N")
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r}; choose one of {IMPLS}")
  if q_segment_ids_BT is not None and kv_segment_ids_BS is None:
    raise ValueError("q_segment_ids_BT given without kv_segment_ids_BS")
  if (q_positions_BT is None) != (kv_positions_BS is None):
    raise ValueError("give both q_positions_BT and kv_positions_BS, or neither")
  if not (isinstance(block_q, int) and isinstance(block_kv, int) and block_q > 0 and block_kv > 0):
    raise ValueError(f"block_q={block_q!r}, block_kv={block_kv!r} must be positive integers")
  if kv_prefix_BS is not None and not causal:
    raise ValueError("kv_prefix_BS (a prefix-LM mask) needs causal=True: without causality "
                     "every key is visible already")
  traced_window = isinstance(sliding_window, jax.Array)
  window = 0 if traced_window else int(sliding_window or 0)
  if window < 0 or ((window or traced_window) and not causal):
    raise ValueError(f"sliding_window={sliding_window!r} must be >= 0 and needs causal=True")
  scale = h ** -0.5 if scale is None else scale
  spec = _Spec(causal, window, q_segment_ids_BT is not None, scale, block_q, block_kv,
               kv_prefix_BS is not None, float(softcap))
  args = (q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT, kv_segment_ids_BS, q_positions_BT,
          kv_positions_BS, kv_prefix_BS)
  naive_only = ("a position bias (bias_fn)" if bias_fn is not None else
                "a per-layer (traced) window" if traced_window else
                "score soft-capping" if softcap else None)
  if naive_only:
    if impl not in ("auto", "naive"):
      _report(impl, f"{naive_only} runs on the naive kernel only", True)
    return _naive(*args, spec, bias_fn=bias_fn,
                  window=sliding_window if traced_window else None)

  explicit = impl in ("cudnn", "pallas")
  if impl == "auto":
    impl = {"gpu": "cudnn", "tpu": "pallas"}.get(parallel.platform(), "default")
  if impl in ("cudnn", "pallas"):
    reason = _fast_path_refusal(impl, *args)
    if reason is None:
      try:
        return (_cudnn if impl == "cudnn" else _pallas)(*args[:4], spec)
      except NotImplementedError as e:  # the kernel's own shape/device checks, at trace time
        reason = str(e)
    _report(impl, reason, explicit)
    impl = "blockwise" if explicit else "default"
  if impl == "default":
    impl = "naive" if t * s < AUTO_NAIVE_MAX_SCORES else "blockwise"
  return (_naive if impl == "naive" else _blockwise)(*args, spec)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """The static part of a call (hashable: it is a nondiff argument of the custom VJP)."""
  causal: bool
  window: int          # 0: no sliding window
  match_segments: bool  # query segment ids given: a key must be in the query's segment
  scale: float
  block_q: int
  block_kv: int
  prefix: bool = False  # kv_prefix given: prefix keys are visible to every query of the segment
  softcap: float = 0.0  # > 0: scores -> softcap·tanh(scores / softcap) (naive kernel)


def visible(q_pos_BT, kv_pos_BS, *, causal=True, window=0, q_seg_BT=None, kv_seg_BS=None,
            kv_prefix_BS=None, empty_keys=True):
  """The visibility rule, the one definition: mask [B|1, T, S], True where query t may see key s.

    causal:     kv_pos <= q_pos, or kv_prefix != 0 (bidirectional prefix, prefix-LM);
    window W:   q_pos - W < kv_pos (W = 0 or None: no window);
    segments:   q_seg == kv_seg when q_seg is given; kv_seg != 0 (padding, empty slots)
                when kv_seg is given, unless `empty_keys=False` (the caller zeroes those rows).

  B may be any leading axis that the arguments share or broadcast over (infer/ragged.py
  passes one row per entry of its page list).
  """
  vis_BTS = jnp.ones((1, 1, 1), bool)
  if causal:
    vis_BTS = kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
    if kv_prefix_BS is not None:
      vis_BTS = vis_BTS | (kv_prefix_BS != 0)[:, None, :]
  if q_seg_BT is not None:
    vis_BTS = vis_BTS & (q_seg_BT[:, :, None] == kv_seg_BS[:, None, :])
  if kv_seg_BS is not None and empty_keys:
    vis_BTS = vis_BTS & (kv_seg_BS != 0)[:, None, :]
  if isinstance(window, jax.Array) or window:
    vis_BTS = vis_BTS & (kv_pos_BS[:, None, :] > q_pos_BT[:, :, None] - window)
  return vis_BTS


def _positions(q_BTNH, k_BSKH, q_pos, kv_pos):
  """int32 positions [B|1, T] and [B|1, S]; indices (batch dimension 1) when not given."""
  if q_pos is None:
    return (jnp.arange(q_BTNH.shape[1], dtype=jnp.int32)[None],
            jnp.arange(k_BSKH.shape[1], dtype=jnp.int32)[None])
  return q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)


# ----------------------------------------------------------------------------- naive

def _naive(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, kv_prefix, spec: _Spec,
           bias_fn=None, window=None):
  """`window`: a traced sliding window, in place of spec.window."""
  b, t, n, h = q_BTNH.shape
  k = k_BSKH.shape[2]
  # Self-attention over one segment-id array (training): a query in a segment sees at
  # least itself, so only padding queries (segment 0) see nothing. The mask stays
  # causal & same-segment and those rows are zeroed at the output: re-masking the
  # [B, K, G, T, S] probabilities would, under sequence parallelism, move a [B, T, S]
  # mask between devices (an [B, T] one moves instead; tests/golden/tensor+sequence.json).
  self_attention = q_seg is not None and q_seg is kv_seg and q_pos is None and t == k_BSKH.shape[1]
  q_pos, kv_pos = _positions(q_BTNH, k_BSKH, q_pos, kv_pos)
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH).astype(jnp.float32)
  scores_BKGTS = scores_BKGTS * spec.scale
  if spec.softcap:
    scores_BKGTS = jnp.tanh(scores_BKGTS / spec.softcap) * spec.softcap
  if bias_fn is not None:
    bias_BNTS = bias_fn(q_pos, kv_pos).astype(jnp.float32)
    scores_BKGTS = scores_BKGTS + bias_BNTS.reshape(bias_BNTS.shape[0], k, n // k, t, -1)
  mask_B11TS = visible(q_pos, kv_pos, causal=spec.causal,
                       window=spec.window if window is None else window, q_seg_BT=q_seg,
                       kv_seg_BS=kv_seg, kv_prefix_BS=kv_prefix, empty_keys=not self_attention)
  mask_B11TS = mask_B11TS[:, None, None]
  scores_BKGTS = jnp.where(mask_B11TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
  if self_attention:
    probs_BKGTS = probs_BKGTS.astype(v_BSKH.dtype)
  else:
    # Masked entries are already exactly 0 unless the whole row is masked (then the
    # softmax is uniform); zeroing them gives such rows a zero output.
    probs_BKGTS = jnp.where(mask_B11TS, probs_BKGTS, 0.0).astype(v_BSKH.dtype)
  out_BTNH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH).reshape(b, t, n, -1)
  return _zero_padding_rows(out_BTNH, q_seg) if self_attention else out_BTNH


# ----------------------------------------------------------------------------- blockwise

def _blockwise(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, kv_prefix, spec: _Spec):
  b, t, n, h = q_BTNH.shape
  s, k = k_BSKH.shape[1:3]
  q_pos, kv_pos = _positions(q_BTNH, k_BSKH, q_pos, kv_pos)
  # Explicit segment ids: padding keys get segment 0, so they are never visible.
  q_seg = jnp.ones((1, t), jnp.int32) if q_seg is None else q_seg.astype(jnp.int32)
  kv_seg = jnp.ones((1, s), jnp.int32) if kv_seg is None else kv_seg.astype(jnp.int32)
  bq, bkv = min(spec.block_q, t), min(spec.block_kv, s)
  spec = dataclasses.replace(spec, block_q=bq, block_kv=bkv)
  tp, sp = -(-t // bq) * bq, -(-s // bkv) * bkv
  # Padded query rows are cut off at the end.
  pad = lambda x, to: jnp.pad(x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  q_BTKGH = pad(q_BTNH, tp).reshape(b, tp, k, n // k, h)
  kv_info = (pad(kv_pos, sp), pad(kv_seg, sp))
  if spec.prefix:
    kv_info += (pad(kv_prefix.astype(jnp.int32), sp),)
  out_BTKGH = _flash(q_BTKGH, pad(k_BSKH, sp), pad(v_BSKH, sp),
                     (pad(q_pos, tp), pad(q_seg, tp)), kv_info, spec)
  return out_BTKGH.reshape(b, tp, n, -1)[:, :t]


def _blocks(x, size):
  """[B, L, ...] -> [L/size, B, size, ...]: the leading axis is scanned over."""
  return jnp.swapaxes(x.reshape(x.shape[0], x.shape[1] // size, size, *x.shape[2:]), 0, 1)


def _unblock(x):
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(q_BTKGH, k_BSKH, mask_BTS, spec):
  """Scaled float32 scores of one tile, -inf where masked: [B, K, G, T, S]."""
  s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  return jnp.where(mask_BTS[:, None, None], s_BKGTS * spec.scale, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BTKGH, k_BSKH, v_BSKH, q_info, kv_info, spec):
  return _flash_fwd(q_BTKGH, k_BSKH, v_BSKH, q_info, kv_info, spec)[0]


def _flash_fwd(q_BTKGH, k_BSKH, v_BSKH, q_info, kv_info, spec):
  b, _, k, g, h = q_BTKGH.shape
  bq, bkv = spec.block_q, spec.block_kv
  kv_blocks = (_blocks(k_BSKH, bkv), _blocks(v_BSKH, bkv), *(_blocks(x, bkv) for x in kv_info))

  def q_block(xs):
    q_BTKGH, q_pos, q_seg = xs

    def kv_step(carry, ys):
      k_BSKH, v_BSKH, kv_pos, kv_seg, *kv_prefix = ys
      # _blockwise fills absent query segment ids with ones: match them only when given.
      mask_BTS = visible(q_pos, kv_pos, causal=spec.causal, window=spec.window,
                         q_seg_BT=q_seg if spec.match_segments else None, kv_seg_BS=kv_seg,
                         kv_prefix_BS=(kv_prefix or [None])[0])

      def update(carry):
        m_BKGT, l_BKGT, acc_BKGTH = carry
        s_BKGTS = _scores(q_BTKGH, k_BSKH, mask_BTS, spec)
        m_new = jnp.maximum(m_BKGT, s_BKGTS.max(-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key seen yet: avoid inf - inf
        p_BKGTS = jnp.exp(s_BKGTS - m_safe[..., None])
        alpha_BKGT = jnp.exp(m_BKGT - m_safe)
        pv_BKGTH = jnp.einsum("BKGTS,BSKH->BKGTH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                              preferred_element_type=jnp.float32)
        return (m_new, alpha_BKGT * l_BKGT + p_BKGTS.sum(-1),
                alpha_BKGT[..., None] * acc_BKGTH + pv_BKGTH)

      # Tiles with no visible key (above the causal diagonal, other documents) are skipped.
      return lax.cond(mask_BTS.any(), update, lambda c: c, carry), None

    init = (jnp.full((b, k, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, k, g, bq), jnp.float32),
            jnp.zeros((b, k, g, bq, v_BSKH.shape[-1]), jnp.float32))
    (m_BKGT, l_BKGT, acc_BKGTH), _ = lax.scan(kv_step, init, kv_blocks)
    seen = l_BKGT > 0
    out_BKGTH = jnp.where(seen[..., None], acc_BKGTH / jnp.where(seen, l_BKGT, 1.0)[..., None], 0.0)
    # lse = +inf for a query that sees nothing: exp(s - lse) is then 0 in the backward pass.
    lse_BKGT = jnp.where(seen, m_BKGT + jnp.log(jnp.where(seen, l_BKGT, 1.0)), jnp.inf)
    return jnp.moveaxis(out_BKGTH, 3, 1).astype(q_BTKGH.dtype), lse_BKGT

  out_QBTKGH, lse_QBKGT = lax.map(
      q_block, (_blocks(q_BTKGH, bq), *(_blocks(x, bq) for x in q_info)))
  out_BTKGH = _unblock(out_QBTKGH)
  return out_BTKGH, (q_BTKGH, k_BSKH, v_BSKH, q_info, kv_info, out_BTKGH, lse_QBKGT)


def _flash_bwd(spec, res, dout_BTKGH):
  q_BTKGH, k_BSKH, v_BSKH, q_info, kv_info, out_BTKGH, lse_QBKGT = res
  bq, bkv = spec.block_q, spec.block_kv
  delta_BTKG = jnp.sum(dout_BTKGH.astype(jnp.float32) * out_BTKGH.astype(jnp.float32), -1)
  delta_QBKGT = jnp.moveaxis(_blocks(delta_BTKG, bq), 2, -1)
  q_blocks = (_blocks(q_BTKGH, bq), _blocks(dout_BTKGH, bq), lse_QBKGT, delta_QBKGT,
              *(_blocks(x, bq) for x in q_info))
  zeros_dq = jnp.zeros(q_blocks[0].shape, jnp.float32)

  def kv_block(dq_QBTKGH, xs):
    k_BSKH, v_BSKH, kv_pos, kv_seg, *kv_prefix = xs

    def q_step(carry, ys):
      q_BTKGH, do_BTKGH, lse_BKGT, delta_BKGT, q_pos, q_seg = ys
      # _blockwise fills absent query segment ids with ones: match them only when given.
      mask_BTS = visible(q_pos, kv_pos, causal=spec.causal, window=spec.window,
                         q_seg_BT=q_seg if spec.match_segments else None, kv_seg_BS=kv_seg,
                         kv_prefix_BS=(kv_prefix or [None])[0])

      def update(carry):
        dk_BSKH, dv_BSKH = carry
        p_BKGTS = jnp.exp(_scores(q_BTKGH, k_BSKH, mask_BTS, spec) - lse_BKGT[..., None])
        dv_BSKH = dv_BSKH + jnp.einsum("BKGTS,BTKGH->BSKH", p_BKGTS.astype(do_BTKGH.dtype),
                                       do_BTKGH, preferred_element_type=jnp.float32)
        dp_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", do_BTKGH, v_BSKH,
                              preferred_element_type=jnp.float32)
        ds_BKGTS = (p_BKGTS * (dp_BKGTS - delta_BKGT[..., None]) * spec.scale).astype(q_BTKGH.dtype)
        dq_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", ds_BKGTS, k_BSKH,
                              preferred_element_type=jnp.float32)
        dk_BSKH = dk_BSKH + jnp.einsum("BKGTS,BTKGH->BSKH", ds_BKGTS, q_BTKGH,
                                       preferred_element_type=jnp.float32)
        return (dk_BSKH, dv_BSKH), dq_BTKGH

      skip = lambda c: (c, jnp.zeros(q_BTKGH.shape, jnp.float32))
      return lax.cond(mask_BTS.any(), update, skip, carry)

    zeros = (jnp.zeros(k_BSKH.shape, jnp.float32), jnp.zeros(v_BSKH.shape, jnp.float32))
    (dk_BSKH, dv_BSKH), dq_part = lax.scan(q_step, zeros, q_blocks)
    return dq_QBTKGH + dq_part, (dk_BSKH, dv_BSKH)

  dq_QBTKGH, (dk_CBSKH, dv_CBSKH) = lax.scan(
      kv_block, zeros_dq, (_blocks(k_BSKH, bkv), _blocks(v_BSKH, bkv),
                           *(_blocks(x, bkv) for x in kv_info)))
  return (_unblock(dq_QBTKGH).astype(q_BTKGH.dtype), _unblock(dk_CBSKH).astype(k_BSKH.dtype),
          _unblock(dv_CBSKH).astype(v_BSKH.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- cudnn / pallas

def _report(impl, reason, explicit):
  if (impl, reason) not in _reported:
    _reported.add((impl, reason))
    (_log.warning if explicit else _log.info)("attention impl=%s falls back: %s", impl, reason)


def _fast_path_refusal(impl, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, kv_prefix):
  """Why `impl` cannot run this call (None: it can). Decided at trace time from static facts."""
  platform = {"cudnn": "gpu", "pallas": "tpu"}[impl]
  t, h = q_BTNH.shape[1], q_BTNH.shape[3]
  if parallel.platform() != platform:
    return f"not on a {platform.upper()} (the mesh's devices are {parallel.platform()!r})"
  if kv_prefix is not None:
    return "a prefix-LM mask (the kernel's masks are causal or full)"
  if q_pos is not None:
    return "explicit positions (the kernel masks by index): decode or offset queries"
  if t != k_BSKH.shape[1]:
    return f"cross/decode attention T={t} != S={k_BSKH.shape[1]}"
  if v_BSKH.shape[-1] != h:
    return f"values {v_BSKH.shape[-1]} wide, keys {h} (latent attention)"
  if kv_seg is not None and q_seg is not kv_seg:
    return "query and key segment ids are different arrays (the kernel assumes self-attention)"
  if impl == "cudnn":
    if q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
      return f"dtype {q_BTNH.dtype} (cuDNN flash attention takes bfloat16/float16)"
    if h % 8 or h > 256:
      return f"head_dim {h} (cuDNN wants a multiple of 8, at most 256)"
    if kv_seg is not None and t % 2:
      return f"odd length {t} with a segment mask (cuDNN's masked backward wants even lengths)"
  if impl == "pallas" and _tpu_block(t, 128) is None:
    return f"length {t} is not a multiple of 128 (splash attention tiles)"
  return None


def _cudnn(q_BTNH, k_BSKH, v_BSKH, seg_BT, spec: _Spec, implementation="cudnn"):
  """cuDNN flash attention; implementation="xla" runs the same call on CPU (tests)."""
  # Segment ids become a dense [B, 1, T, S] mask (jax adds it as a bias): O(B·T·S)
  # memory, but not per head, and the kernel stays fused.
  mask_B1TS = None
  if seg_BT is not None:
    # Padding keys are seen only by padding queries, whose rows are zeroed below.
    mask_B1TS = (seg_BT[:, :, None] == seg_BT[:, None, :])[:, None]
  out_BTNH = jax.nn.dot_product_attention(
      q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS, scale=spec.scale, is_causal=spec.causal,
      local_window_size=(spec.window - 1, 0) if spec.window else None,
      implementation=implementation)
  return _zero_padding_rows(out_BTNH, seg_BT)


def _tpu_block(length, want):
  """The largest multiple of 128 that is <= want and divides length (None: none does)."""
  for block in range(min(want, length) // 128 * 128, 0, -128):
    if length % block == 0:
      return block
  return None


def _pallas(q_BTNH, k_BSKH, v_BSKH, seg_BT, spec: _Spec, interpret=False):
  """Splash attention; `interpret=True` runs the kernel on CPU (tests)."""
  kernel = functools.partial(_splash, spec=spec, interpret=interpret)
  if jax.sharding.get_abstract_mesh().empty:
    return kernel(q_BTNH, k_BSKH, v_BSKH, seg_BT)
  # XLA cannot partition a Pallas kernel: run one per device on its batch rows and
  # heads (a split sequence is gathered on entry).
  q_names = ("act_batch", None, "act_heads", None)
  kv_names = ("act_batch", None, "act_kv_heads", None)
  if seg_BT is None:
    return shard_map_logical(lambda q, k, v: kernel(q, k, v, None), (q_names, kv_names, kv_names),
                             q_names)(q_BTNH, k_BSKH, v_BSKH)
  return shard_map_logical(kernel, (q_names, kv_names, kv_names, ("act_batch", None)),
                           q_names)(q_BTNH, k_BSKH, v_BSKH, seg_BT)


def _splash(q_BTNH, k_BSKH, v_BSKH, seg_BT, spec: _Spec, interpret: bool):
  # Imported here so that CPU/GPU runs never load the TPU kernels.
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  b, t, n, h = q_BTNH.shape
  if spec.window:
    one = masks.LocalMask((t, t), window_size=(spec.window - 1, 0), offset=0)
  elif spec.causal:
    one = masks.CausalMask((t, t))
  else:
    one = masks.FullMask((t, t))
  bq, bkv = _tpu_block(t, spec.block_q) or t, _tpu_block(t, spec.block_kv) or t
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                            block_kv_dq=bkv)
  kernel = splash.make_splash_mha(masks.MultiHeadMask([one] * n), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)
  # Splash does not scale the logits; heads lead, and GQA is native (N % K == 0).
  q_BNTH = jnp.swapaxes(q_BTNH * jnp.asarray(spec.scale, q_BTNH.dtype), 1, 2)
  k_BKSH, v_BKSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
  if seg_BT is None:
    out_BNTH = jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH)
  else:
    seg_BT = seg_BT.astype(jnp.int32)
    out_BNTH = jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH,
                                segment_ids=splash.SegmentIds(q=seg_BT, kv=seg_BT))
  # Padding queries (segment 0) attended padding keys; by our rule they see nothing.
  return _zero_padding_rows(jnp.swapaxes(out_BNTH, 1, 2).astype(q_BTNH.dtype), seg_BT)


def _zero_padding_rows(out_BTNH, seg_BT):
  if seg_BT is None:
    return out_BTNH
  return jnp.where((seg_BT != 0)[:, :, None, None], out_BTNH, jnp.zeros((), out_BTNH.dtype))
