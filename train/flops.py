"""Model FLOPs per token and the per-device peak that MFU is measured against.

Training FLOPs per token follow MaxText's count: 3x the forward matmuls
(forward + backward), i.e. 6 * N_matmul per token, plus causal attention
4 * T * N * H / 2 per layer forward. N_matmul counts every weight used in a
matmul (QKV, output, SwiGLU's three, unembedding); the embedding lookup and
norms are not matmuls; an MoE layer counts the router and the top-k
experts a token uses. Remat recomputation is not useful work and is not counted.
An encoder's attention is not causal (all T·T scores count); an encoder-decoder
counts, per target token, one source token through the encoder (sources taken
as long as targets) and the decoder's self- and cross-attention.
"""

import time

import jax
import jax.numpy as jnp

from models import ModelConfig

# Dense bf16 peak per chip in FLOP/s, from the vendors' data sheets.
PEAK_FLOPS_BF16 = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA A100": 312e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
}


def _attention_projections(cfg: ModelConfig) -> int:
  """Weights one token's attention projections use (latent attention: the expanded form it
  trains in, models/mla.py)."""
  d, h, n, k = cfg.d_model, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  if not cfg.mla:
    return d * (n + 2 * k) * h + d * n * h  # q, k, v and the output
  r, c, q, u = cfg.rope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.value_dim
  queries = d * q + q * n * (h + r) if q else d * n * (h + r)
  return queries + d * (c + r) + c * n * (h + u) + n * u * d


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  d, h, n = cfg.d_model, cfg.head_dim, cfg.num_heads
  projections = 2 * _attention_projections(cfg)
  per_layer = 2 * cfg.mlp_params(active=True) + projections
  # one query's score and value matmuls over every key (latent attention: keys H + R wide,
  # values U)
  full = 2 * seq_len * n * (2 * h if not cfg.mla else h + cfg.rope_head_dim + cfg.value_dim)
  unembed = 2 * d * cfg.vocab_size
  if cfg.arch == "encoder":
    forward = cfg.num_layers * (per_layer + full) + unembed
  elif cfg.arch == "encoder_decoder":
    decoder = per_layer + full / 2 + projections + full  # causal self-, then cross-attention
    forward = cfg.num_layers * (per_layer + full) + cfg.decoder_layers * decoder + unembed
  else:  # causal: half the score/value matmuls are masked (a prefix-LM's prompt is ignored)
    forward = cfg.num_layers * (per_layer + full / 2) + unembed
    if cfg.first_dense_layers:  # those blocks' dense MLP in place of the routed experts
      forward += 2 * cfg.first_dense_layers * (cfg.dense_config.mlp_params()
                                               - cfg.mlp_params(active=True))
  return 3.0 * forward


def measure_matmul_peak(dtype=jnp.float32, n: int = 2048, repeats: int = 5) -> float:
  """Best achieved FLOP/s of one large square matmul on the default device."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def peak_flops_per_device(dtype=jnp.float32, override: float = 0.0) -> tuple[float, str]:
  """(peak FLOP/s, where it came from). CPUs have no data-sheet number: we measure one."""
  if override > 0:
    return override, "config"
  kind = jax.devices()[0].device_kind
  for name, flops in PEAK_FLOPS_BF16.items():
    if kind.startswith(name):
      return flops, f"datasheet bf16 ({kind})"
  return measure_matmul_peak(dtype), f"measured {jnp.dtype(dtype).name} matmul ({kind})"
