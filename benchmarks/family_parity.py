"""Each decoder family (models/families/) against transformers, on random tiny models built with
transformers' own config classes: the largest float32 logit difference, whether 32 greedy
tokens equal `generate` through the Engine's KV cache and through paged serving, and the
logit difference after our export loads back in transformers. One JSON document.

  python benchmarks/family_parity.py --json [--families gemma2,qwen3]

tests/test_families.py holds the same models to the bound (1e-4) and to token equality.
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from infer import Engine, SamplingParams  # noqa: E402
from infer.serving import PagedEngine  # noqa: E402

TOL = 1e-4
VOCAB = 211
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=None)
FAMILIES = {
    # Qwen2.5-0.5B's shape in small: q/k/v biases, tied embeddings, rope base 1e6.
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True,
                                              use_sliding_window=False, sliding_window=4096),
    # Qwen3-0.6B's in small: per-head q/k RMSNorm, head_dim 32 (not hidden / heads = 16).
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, rope_theta=1e6, head_dim=32,
                                              tie_word_embeddings=True, use_sliding_window=False),
    # Mistral-7B-v0.1's in small: every layer attends to the last 8 positions only, so the
    # 48-token prompts and 24 + 32-token generations run far past the window.
    "mistral": lambda: transformers.MistralConfig(**COMMON, rope_theta=1e4, sliding_window=8,
                                                  tie_word_embeddings=False),
    # Gemma-2-2B's in small: local (window 8) and global layers alternating, soft caps tight
    # enough to bend the scores and logits, a query scale (query_pre_attn_scalar) of its own.
    "gemma2": lambda: transformers.Gemma2Config(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh"),
    # Gemma-3-1B's in small: q/k norms, local layers on their own RoPE base, global ones with
    # linear scaling, an irregular local/global layout.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
    # Mixtral-8x7B's in small: 4 experts of 48, top-2 renormalised, rope base 1e6.
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
        tie_word_embeddings=False),
    # Qwen3-30B-A3B's in small: Qwen3's attention, 4 experts of 48, top-2 renormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, rope_theta=1e6, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True),
    # OLMoE-1B-7B's in small: a q/k norm across heads, top-2 of 4 experts, not renormalised.
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=False),
    # Qwen1.5-MoE-A2.7B's in small: q/k/v biases, top-2 of 4 experts and a gated shared expert.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False),
    # Phi-3-mini-4k's in small: fused qkv and gate_up projections, a sliding window of 8.
    "phi3": lambda: transformers.Phi3Config(**COMMON, sliding_window=8, pad_token_id=0,
                                            original_max_position_embeddings=128),
    # DeepSeek-V3's in small: latent attention with a query latent (q_lora_rank), 8 experts in
    # 4 groups routed by sigmoid scores with the balancing bias, one shared expert, the first
    # block dense; YaRN with mscale, so the 48-token prompts run past the 16 original positions.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=8.0, beta_fast=32,
                             beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=16)),
    # DeepSeek-V2-Lite's in small: queries projected directly, a softmax over 8 experts, top-2
    # unnormalised, two shared experts, the first block dense.
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0),
    # Phi-3-mini-128k's in small: longrope, short factors within 16 positions and long ones
    # past them (the 48-token prompts, and the generations, cross the line), its cos/sin
    # scale from 128 / 16.
    "phi3_longrope": lambda: transformers.Phi3Config(
        **COMMON, pad_token_id=0, original_max_position_embeddings=16,
        rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                             short_factor=[1.0 + 0.05 * i for i in range(8)],
                             long_factor=[1.0 + 0.9 * i for i in range(8)])),
    # A Llama with dynamic NTK scaling: past 32 positions the base grows with the sequence
    # (transformers' generate grows it token by token, as the Engine does).
    "llama_dynamic": lambda: transformers.LlamaConfig(
        **{**COMMON, "max_position_embeddings": 32},
        rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
    # Llama-3.2-1B's in small: llama3 rope scaling, tied embeddings.
    "llama3.2": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16)),
}


def write_tokenizer(directory, vocab_size: int = VOCAB, chat_template: str | None = None) -> None:
  """A word-level tokenizer w3..wN with <s>/</s> specials (and a chat template)."""
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>",
               **({"chat_template": chat_template} if chat_template else {})}, f)


def make_family(name: str, directory: str, chat_template: str | None = None):
  """(transformers model, our load of its saved directory, tokenizer): random weights, with
  non-zero biases and norm scales so that a dropped one shows."""
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
  with torch.no_grad():
    for pname, p in hf.named_parameters():
      if pname.endswith("bias") or pname.endswith("norm.weight"):
        p.copy_((1.0 if pname.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
    for bname, buf in hf.named_buffers():  # DeepSeek-V3's balancing bias, zero at init
      if bname.endswith("e_score_correction_bias"):
        buf.copy_(0.3 * torch.randn_like(buf))
  hf.save_pretrained(directory)
  write_tokenizer(directory, chat_template=chat_template)
  ours, tokenizer = models.load_pretrained(str(directory))
  return hf, ours, tokenizer


def logits(model, tokens_BT):
  if isinstance(model, torch.nn.Module):
    with torch.no_grad():
      return model(torch.from_numpy(tokens_BT.astype(np.int64))).logits.float().numpy()
  with jax.default_matmul_precision("highest"):  # one compiled forward, not op by op
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens_BT)))


def logit_diff(hf, ours, length: int = 48) -> float:
  tokens_BT = np.random.default_rng(0).integers(3, VOCAB, size=(2, length), dtype=np.int32)
  return float(np.max(np.abs(logits(ours, tokens_BT) - logits(hf, tokens_BT))))


def greedy_pair(hf, ours, tokenizer, prompt_len: int = 24, new: int = 32,
                engine_class=Engine) -> tuple[list[int], list[int]]:
  """(transformers' greedy tokens, ours) after a random prompt: a prefill, then decode steps
  through the engine's KV cache (PagedEngine: paged blocks of 4)."""
  prompt = np.random.default_rng(1).integers(3, VOCAB, size=(prompt_len,)).tolist()
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
  kw = dict(block_size=4) if engine_class is PagedEngine else {}
  engine = engine_class(ours, tokenizer, prompt_len + new, 1, **kw)
  with jax.default_matmul_precision("highest"):
    (got,) = engine.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))
  return want, got.token_ids


def exported_back(ours, tokenizer, directory):
  """Our export of `ours`, loaded by transformers, and its logits' distance from ours."""
  models.export_hf(ours, tokenizer, str(directory))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                           dtype=torch.float32).eval()
  tokens_BT = np.random.default_rng(2).integers(3, VOCAB, size=(1, 40), dtype=np.int32)
  return back, float(np.max(np.abs(logits(ours, tokens_BT) - logits(back, tokens_BT))))


def measure(name: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    hf, ours, tokenizer = make_family(name, os.path.join(tmp, "hf"))
    back, export_diff = exported_back(ours, tokenizer, os.path.join(tmp, "out"))
    return {
        "architecture": type(hf).__name__, "logit_max_abs_diff": logit_diff(hf, ours),
        "greedy_32_equal_engine": (lambda p: p[0] == p[1])(greedy_pair(hf, ours, tokenizer)),
        "greedy_32_equal_paged": (lambda p: p[0] == p[1])(
            greedy_pair(hf, ours, tokenizer, engine_class=PagedEngine)),
        "export_loads_as": type(back).__name__, "export_logit_max_abs_diff": export_diff,
    }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document (default)")
  parser.add_argument("--families", default=",".join(FAMILIES),
                      help=f"comma-separated, of {sorted(FAMILIES)}")
  args = parser.parse_args(argv)
  names = [n for n in args.families.split(",") if n]
  unknown = sorted(set(names) - set(FAMILIES))
  if unknown:
    parser.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
  out = {"tolerance": TOL, "transformers": transformers.__version__,
         "families": {n: measure(n) for n in names}}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
