"""Worker: each new family mechanism (models/families/) compiled and trained for 10 steps on 8
fake devices and on one, as tests/workers/layouts.py does for the base models.

Run in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8.
argv: OUT.json. Per mechanism: the golden record (parameter and activation specs, collectives
in the compiled step), the losses, and the largest relative parameter difference from one
device after the 10 steps.
"""

import json
import sys

import jax
import numpy as np

import parallel
from layouts import run
from models import ModelConfig

BASE = dict(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            tie_embeddings=False)
GEMMA = dict(head_dim=16, mlp_activation="geglu", sandwich_norms=True, norm_offset=1.0,
             embed_scale=True, attention_scale=24 ** -0.5, sliding_window=8, layer_pattern="LG")
MLA = dict(head_dim=16, kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, v_head_dim=12,
           rope_interleaved=True)
# name -> (layout, mesh, model): a dense mechanism under FSDP + tensor parallelism, an MoE one
# under FSDP + expert parallelism.
MECHANISMS = {
    # soft-capped scores and logits, local/global layers (Gemma 2)
    "gemma2": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2),
               ModelConfig(**BASE, **GEMMA, attn_softcap=2.0, final_softcap=3.0)),
    # q/k/v biases (Qwen2)
    "qwen2": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2), ModelConfig(**BASE, qkv_bias=True)),
    # per-head q/k norms (Qwen3)
    "qwen3": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2),
              ModelConfig(**BASE, qk_norm=True, head_dim=32)),
    # a sliding window on every layer (Mistral, Phi-3)
    "mistral": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2),
                ModelConfig(**BASE, sliding_window=8)),
    # per-head q/k norms with renormalised top-k experts (Qwen3-MoE)
    "qwen3_moe": ("fsdp+expert", dict(fsdp=2, expert=4),
                  ModelConfig(**BASE, num_experts=8, top_k=2, router_norm="topk", qk_norm=True)),
    # per-head q/k norms, two RoPE bases (Gemma 3)
    "gemma3": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2),
               ModelConfig(**BASE, **GEMMA, qk_norm=True, rope_local_theta=1e4)),
    # a sigmoid-gated shared expert beside routed ones, q/k/v biases (Qwen2-MoE)
    "qwen2_moe": ("fsdp+expert", dict(fsdp=2, expert=4),
                  ModelConfig(**BASE, num_experts=8, top_k=2, router_norm="all", qkv_bias=True,
                              shared_mlp_dim=48, shared_gate=True)),
    # one q/k norm across all heads (OLMoE)
    "olmoe": ("fsdp+expert", dict(fsdp=2, expert=4),
              ModelConfig(**BASE, num_experts=8, top_k=2, router_norm="all", qk_norm_full=True)),
    # multi-head latent attention with a query latent (DeepSeek-V3's attention)
    "mla": ("fsdp+tensor", dict(data=2, fsdp=2, tensor=2),
            ModelConfig(**{**BASE, "num_kv_heads": 4}, **MLA)),
    # DeepSeek-V3's experts: sigmoid scores within the best groups, the balancing bias, routed
    # scaling, a shared expert, the first block dense (its own stack)
    "deepseek_moe": ("fsdp+expert", dict(fsdp=2, expert=4),
                     ModelConfig(**{**BASE, "num_kv_heads": 4, "num_layers": 3}, **MLA,
                                 num_experts=8, top_k=2, router_score="sigmoid",
                                 router_groups=4, router_group_topk=2, router_bias_rate=1e-3,
                                 routed_scale=2.5, shared_mlp_dim=32, first_dense_layers=1,
                                 dense_mlp_dim=96)),
}


def main():
  out_path = sys.argv[1]
  one = parallel.make_mesh({}, devices=jax.devices()[:1])
  results = {}
  for name, (layout, sizes, model) in MECHANISMS.items():
    base_losses, base_params, _, _ = run("data_parallel", one, model)
    losses, params, golden, _ = run(layout, parallel.make_mesh(sizes), model)
    diffs = {k: float(np.max(np.abs(params[k] - v)) / (np.max(np.abs(v)) + 1e-12))
             for k, v in base_params.items()}
    results[name] = {"losses": losses, "base_losses": base_losses, "param_rel_diff": diffs,
                     "golden": {**golden, "layout": layout}}
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
