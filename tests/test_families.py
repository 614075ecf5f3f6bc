"""Decoder families beyond Llama and Mixtral (models/families/, issue 57): random tiny
models built with transformers' own config classes load with its float32 logits, generate
its greedy tokens through the KV cache, train, and export back to a directory transformers
loads with equal logits."""

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import models  # noqa: E402
from infer import Engine, SamplingParams  # noqa: E402
from infer.serving import PagedEngine  # noqa: E402
from test_hf_parity import _write_tokenizer  # noqa: E402

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
    # Llama-3.2-1B's in small: llama3 rope scaling, tied embeddings.
    "llama3.2": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param.replace(".", "_"))
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[request.param]()).eval()
  with torch.no_grad():  # non-zero biases and norm scales, so a dropped one shows
    for name, p in hf.named_parameters():
      if name.endswith("bias") or name.endswith("norm.weight"):
        p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
  hf.save_pretrained(directory)
  _write_tokenizer(directory, VOCAB)
  ours, tokenizer = models.load_pretrained(str(directory))
  return request.param, hf, ours, tokenizer


def logits(model, tokens_BT):
  if isinstance(model, torch.nn.Module):
    with torch.no_grad():
      return model(torch.from_numpy(tokens_BT.astype(np.int64))).logits.float().numpy()
  with jax.default_matmul_precision("highest"):
    return np.asarray(model(jnp.asarray(tokens_BT)))


def greedy_tokens_match(hf, ours, tokenizer, prompt_len: int, new: int = 32,
                        engine_class=Engine) -> None:
  """`new` greedy tokens after a random prompt: transformers' generate against our engine
  (a prefill, then decode steps through its KV cache; PagedEngine: paged blocks of 4)."""
  prompt = np.random.default_rng(1).integers(3, VOCAB, size=(prompt_len,)).tolist()
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
  kw = dict(block_size=4) if engine_class is PagedEngine else {}
  engine = engine_class(ours, tokenizer, prompt_len + new, 1, **kw)
  with jax.default_matmul_precision("highest"):
    (got,) = engine.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))
  assert got.token_ids == want


def exported_back(ours, tokenizer, directory):
  """Our export of `ours`, loaded by transformers, and its logits' distance from ours."""
  models.export_hf(ours, tokenizer, str(directory))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                           dtype=torch.float32).eval()
  tokens_BT = np.random.default_rng(2).integers(3, VOCAB, size=(1, 40), dtype=np.int32)
  return back, float(np.max(np.abs(logits(ours, tokens_BT) - logits(back, tokens_BT))))


def test_logits_match_transformers(family):
  _, hf, ours, _ = family
  tokens_BT = np.random.default_rng(0).integers(3, VOCAB, size=(2, 48), dtype=np.int32)
  assert np.max(np.abs(logits(ours, tokens_BT) - logits(hf, tokens_BT))) <= TOL


def test_greedy_generation_matches_through_the_kv_cache(family):
  _, hf, ours, tokenizer = family
  greedy_tokens_match(hf, ours, tokenizer, prompt_len=24)


def test_paged_serving_generates_the_same_tokens(family):
  _, hf, ours, tokenizer = family
  greedy_tokens_match(hf, ours, tokenizer, prompt_len=24, engine_class=PagedEngine)


def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
  _, hf, ours, tokenizer = family
  back, diff = exported_back(ours, tokenizer, tmp_path / "out")
  assert type(back) is type(hf) and diff <= TOL
