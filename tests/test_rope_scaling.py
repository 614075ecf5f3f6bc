"""RoPE context extension as transformers runs it (models/rope.py, issue 57): random Llamas
with rope_parameters of each scheme load with its logits at a length past their original
context, generate its greedy tokens through the KV cache, and export back."""

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import models  # noqa: E402
from models import ModelConfig, rope  # noqa: E402
from benchmarks.family_parity import VOCAB, exported_back, greedy_pair, logits  # noqa: E402
from test_hf_parity import _write_tokenizer  # noqa: E402

TOL = 1e-4
ORIGINAL = 16  # the "pretraining" context; prompts run to 48 and generation to 80
SCHEMES = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn_explicit": dict(rope_type="yarn", factor=8.0, beta_fast=16.0, beta_slow=2.0,
                          attention_factor=1.3, original_max_position_embeddings=ORIGINAL),
}


def hf_llama(directory, scheme: str, theta=500000.0):
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      rope_parameters=dict(rope_theta=theta, **SCHEMES[scheme]), rms_norm_eps=1e-5,
      initializer_range=0.2, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(directory)
  _write_tokenizer(directory, VOCAB)
  return model


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def pair(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  hf = hf_llama(directory, request.param)
  ours, tokenizer = models.load_pretrained(str(directory))
  return request.param, hf, ours, tokenizer


def test_the_scheme_is_read(pair):
  scheme, _, ours, _ = pair
  assert ours.cfg.rope_scaling == SCHEMES[scheme]["rope_type"]
  assert ours.cfg.rope_factor == SCHEMES[scheme]["factor"]


def test_logits_match_past_the_original_context(pair):
  _, hf, ours, _ = pair
  tokens_BT = np.random.default_rng(0).integers(3, VOCAB, size=(2, 48), dtype=np.int32)
  assert np.max(np.abs(logits(ours, tokens_BT) - logits(hf, tokens_BT))) <= TOL


def test_greedy_generation_matches_through_the_cache(pair):
  _, hf, ours, tokenizer = pair
  want, got = greedy_pair(hf, ours, tokenizer, prompt_len=40)  # to 72, past the original 16
  assert got == want


def test_export_loads_in_transformers_with_equal_logits(pair, tmp_path):
  scheme, _, ours, tokenizer = pair
  back, diff = exported_back(ours, tokenizer, tmp_path / "out")
  assert back.config.rope_parameters["rope_type"] == SCHEMES[scheme]["rope_type"]
  assert diff <= TOL


def test_unsupported_schemes_are_refused_by_name():
  """What config.json cannot say (a GGUF's per-frequency "factors", Phi-3's old "su" name) or
  says incompletely (longrope without its factors), and YaRN's mscale outside DeepSeek."""
  for params, match in (({"rope_type": "factors"}, "'factors' is not supported"),
                        ({"rope_type": "su"}, "'su' is not supported"),
                        ({"rope_type": "longrope", "original_max_position_embeddings": 16},
                         "short_factors / long_factors go together"),
                        ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                          "original_max_position_embeddings": 16}, r"\['mscale'\]")):
    with pytest.raises(ValueError, match=match):
      ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2,
                  mlp_dim=16, **rope.from_hf(params, "config.json", 128))


def test_default_rope_is_unchanged():
  # The default path computes its frequencies as before (the SmolLM2 and Mixtral goldens).
  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  pos = jnp.arange(5)[None]
  inv = 1e4 ** (-jnp.arange(0, 8, 2, dtype=jnp.float32) / 8)
  ang = pos[..., None] * inv
  sin, cos = jnp.sin(ang)[:, :, None], jnp.cos(ang)[:, :, None]
  want = jnp.concatenate([x[..., :4] * cos - x[..., 4:] * sin, x[..., 4:] * cos + x[..., :4] * sin],
                         -1)
  assert jnp.array_equal(rope.apply(x, pos, 1e4), want)


def test_phi3_128k_reads_its_top_level_original_context():
  """Phi-3-mini-128k's config.json keeps original_max_position_embeddings beside, not inside,
  its rope_scaling (and may call longrope "su"): read as transformers reads it."""
  from models.families import config_from_hf
  hf = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
  cfg = config_from_hf(hf)
  assert (cfg.rope_scaling, cfg.rope_original_max_len, cfg.rope_factor) == ("longrope", 4096, 32.0)
