"""Mixture-of-experts layer: a float32 router, top-k gating and routed SwiGLU experts.

The layer replaces a block's dense MLP when `model.num_experts > 0`. Expert
weights carry logical names (`experts`, `embed`, `mlp`) like every other
parameter; when the active rules split `experts` over mesh axes the dispatch
runs per device inside shard_map with all-to-all (models/moe_dispatch.py).

Each call also returns per-layer router statistics over real (non-padding)
tokens: the load of every expert, dropped choices, the Switch/GShard
load-balancing loss, the router z-loss and the router entropy. train/step.py
adds the weighted losses to the training loss and logs the rest.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from models import moe_dispatch
from models.config import ModelConfig
from models.layers import MLP, cast, normal_param


def _top_k_indices(scores_BTE, k: int):
  """jax.lax.top_k(scores_BTE, k)[1] (ties: lower index first), by a stable sort.

  XLA's SPMD partitioner does not split top_k over a sharded batch: it gathers
  every device's scores and routes the whole global batch on each device. A
  sort along the expert axis keeps the batch split.
  """
  return jnp.argsort(scores_BTE, axis=-1, descending=True, stable=True)[..., :k].astype(jnp.int32)


def route(logits_BTE, bias_E, k: int, norm: str, score: str = "softmax", groups: int = 0,
          group_topk: int = 0, scale: float = 1.0):
  """(expert_BTO, weight_BTO, probs_BTE): top-k choice in float32.

  Scores are a softmax over the experts, or each expert's sigmoid (`score`, DeepSeek-V3).
  `bias_E` (auxiliary-loss-free balancing) shifts which experts are chosen, never the
  weights they get. With `groups` > 1 the experts form equal groups and a token chooses only
  within its `group_topk` best (DeepSeek's group-limited routing: a group ranks by its best
  two biased sigmoid scores, or its best softmax score). norm="topk" renormalises the chosen
  scores (Mixtral: softmax over the chosen k); "all" keeps them; `scale` multiplies them.
  probs_BTE (the statistics' router probabilities) are the scores over their sum.
  """
  if score == "sigmoid":
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
  else:
    scores_BTE = probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
  choice_BTE = scores_BTE if bias_E is None else scores_BTE + jax.lax.stop_gradient(bias_E)
  if groups > 1:
    choice_BTE = _within_best_groups(choice_BTE, groups, group_topk, score)
  expert_BTO = _top_k_indices(choice_BTE, k)
  weight_BTO = jnp.take_along_axis(scores_BTE, expert_BTO, axis=-1)
  if norm == "topk":
    # DeepSeek-V3 adds 1e-20: sigmoid scores can all be tiny; softmax ones sum to > 0
    eps = 1e-20 if score == "sigmoid" else 0.0
    weight_BTO = weight_BTO / (jnp.sum(weight_BTO, axis=-1, keepdims=True) + eps)
  if scale != 1.0:
    weight_BTO = weight_BTO * scale
  return expert_BTO, weight_BTO, probs_BTE


def _within_best_groups(choice_BTE, groups: int, group_topk: int, score: str):
  """choice_BTE with the experts outside each token's best `group_topk` groups at -inf."""
  b, t, e = choice_BTE.shape
  choice_BTGP = choice_BTE.reshape(b, t, groups, e // groups)
  if score == "sigmoid":
    rank_BTG = jnp.sum(jax.lax.top_k(choice_BTGP, 2)[0], axis=-1)
  else:
    rank_BTG = jnp.max(choice_BTGP, axis=-1)
  best_BTJ = _top_k_indices(rank_BTG, group_topk)
  keep_BTG = jnp.any(jax.nn.one_hot(best_BTJ, groups, dtype=bool), axis=-2)
  return jnp.where(keep_BTG[..., None], choice_BTGP, -jnp.inf).reshape(b, t, e)


def router_stats(logits_BTE, probs_BTE, expert_BTO, dropped_BTO, mask_BT):
  """Per-layer sums and losses over real tokens (mask_BT), all float32.

  aux_loss = E * sum_e f_e * P_e, with f_e the share of the T*k choices that
  went to expert e and P_e its mean router probability: 1 when uniform.
  """
  e = probs_BTE.shape[-1]
  k = expert_BTO.shape[-1]
  m_BT = mask_BT.astype(jnp.float32)
  tokens = jnp.maximum(jnp.sum(m_BT), 1.0)
  load_E = jnp.einsum("BTOE,BT->E", jax.nn.one_hot(expert_BTO, e, dtype=jnp.float32), m_BT)
  prob_E = jnp.einsum("BTE,BT->E", probs_BTE, m_BT) / tokens
  aux = e * jnp.sum(jax.lax.stop_gradient(load_E) / (tokens * k) * prob_E)
  z = jnp.sum(jax.nn.logsumexp(logits_BTE, axis=-1) ** 2 * m_BT) / tokens
  entropy_BT = -jnp.sum(probs_BTE * jnp.log(jnp.maximum(probs_BTE, 1e-30)), axis=-1)
  return {
      "load": load_E,
      "tokens": jnp.sum(m_BT),
      "dropped": jnp.sum(dropped_BTO.astype(jnp.float32) * m_BT[..., None]),
      "aux_loss": aux,
      "z_loss": z,
      "entropy": jnp.sum(jax.lax.stop_gradient(entropy_BT) * m_BT) / tokens,
  }


class MoE(nnx.Module):
  """x_BTD -> (sum over the top-k experts of weight * SwiGLU_e(x) [+ shared MLP], stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, e = cfg.d_model, cfg.mlp_dim, cfg.num_experts
    self.cfg = cfg
    self.router_DE = normal_param(rngs, (d, e), ("embed", None), cfg, cfg.init_std)
    if cfg.router_bias_rate:
      # Updated by train/step.py from the measured load, not by the optimizer.
      self.router_bias_E = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(None,),
                                     eager_sharding=False)
    self.gate_EDF = normal_param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg, cfg.init_std)
    self.up_EDF = normal_param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg, cfg.init_std)
    self.down_EFD = normal_param(rngs, (e, f, d), ("experts", "mlp", "embed"), cfg, cfg.init_std)
    if cfg.shared_mlp_dim:
      self.shared = MLP(dataclasses.replace(cfg.dense_config, mlp_dim=cfg.shared_mlp_dim), rngs)
    if cfg.shared_gate:  # Qwen2-MoE: the shared expert's output times sigmoid(x·w)
      self.shared_gate_D1 = normal_param(rngs, (d, 1), ("embed", None), cfg, cfg.init_std)

  def _impl(self) -> str:
    impl = self.cfg.grouped_matmul
    if impl == "auto":
      impl = "tiled" if parallel.platform() == "cpu" else "ragged_dot"
    return impl

  def __call__(self, x_BTD, segment_ids_BT=None):
    cfg = self.cfg
    dt = cfg.jnp_dtype
    logits_BTE = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32),
                            self.router_DE[...].astype(jnp.float32))
    bias_E = self.router_bias_E[...] if cfg.router_bias_rate else None
    expert_BTO, weight_BTO, probs_BTE = route(
        logits_BTE, bias_E, cfg.top_k, cfg.router_norm, cfg.router_score, cfg.router_groups,
        cfg.router_group_topk, cfg.routed_scale)
    w = (self.gate_EDF[...], self.up_EDF[...], self.down_EFD[...])
    mask_BT = (jnp.ones(x_BTD.shape[:2], bool) if segment_ids_BT is None
               else segment_ids_BT > 0)
    out_BTD, dropped_BTO = self._experts(x_BTD.astype(dt), expert_BTO, weight_BTO, mask_BT, w)
    if cfg.shared_mlp_dim:
      shared_BTD = self.shared(x_BTD)
      if cfg.shared_gate:
        gate_BT = jnp.einsum("BTD,D->BT", x_BTD.astype(dt), cast(self.shared_gate_D1, dt)[:, 0])
        shared_BTD = jax.nn.sigmoid(gate_BT)[..., None] * shared_BTD
      out_BTD = out_BTD + shared_BTD
    stats = router_stats(logits_BTE, probs_BTE, expert_BTO, dropped_BTO, mask_BT)
    return parallel.constrain(out_BTD, ("act_batch", "act_res_seq", "act_embed")), stats

  def _experts(self, x_BTD, expert_BTO, weight_BTO, mask_BT, w):
    cfg = self.cfg
    if cfg.moe_impl == "capacity":
      run = lambda x, e, g, m, w, ep: moe_dispatch.capacity_dispatch(
          x, e, g, w, cfg.num_experts, cfg.capacity_factor, ep, mask_BT=m)
    else:
      impl = self._impl()
      # Padding is computed but cannot crowd out real tokens: there is no capacity.
      run = lambda x, e, g, m, w, ep: (moe_dispatch.dropless(x, e, g, w, impl, ep),
                                       jnp.zeros(e.shape, bool))
    ep_axes = parallel.expert_axes()
    if ep_axes is None:
      return run(x_BTD, expert_BTO, weight_BTO, mask_BT, w, None)
    parallel.check_experts_divide(cfg.num_experts)
    # Capacity is per sequence: each device must hold whole sequences (gathered if split).
    seq = None if cfg.moe_impl == "capacity" else "act_seq"
    tokens = ("act_batch", seq, None)
    experts = ("experts", None, None)
    fn = parallel.shard_map_logical(lambda x, e, g, m, w: run(x, e, g, m, w, ep_axes),
                                    in_names=(tokens, tokens, tokens, tokens[:2], (experts,) * 3),
                                    out_names=(tokens, tokens))
    return fn(x_BTD, expert_BTO, weight_BTO, mask_BT, w)
