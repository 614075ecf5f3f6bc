"""Decoder families beyond Llama and Mixtral (models/families/, issue 57): random tiny models
built with transformers' own config classes (benchmarks/family_parity.py) load with its
float32 logits, generate its greedy tokens through the KV cache and paged serving, and export
back to a directory transformers loads with equal logits."""

import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

from benchmarks.family_parity import (FAMILIES, TOL, exported_back, greedy_pair,  # noqa: E402
                                      logit_diff, make_family)
import models  # noqa: E402
from infer.serving import PagedEngine  # noqa: E402


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param.replace(".", "_"))
  return (request.param, *make_family(request.param, str(directory)))


def test_logits_match_transformers(family):
  _, hf, ours, _ = family
  assert logit_diff(hf, ours) <= TOL


def test_greedy_generation_matches_through_the_kv_cache(family):
  _, hf, ours, tokenizer = family
  want, got = greedy_pair(hf, ours, tokenizer)
  assert got == want


def test_paged_serving_generates_the_same_tokens(family):
  _, hf, ours, tokenizer = family
  want, got = greedy_pair(hf, ours, tokenizer, engine_class=PagedEngine)
  assert got == want


def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
  _, hf, ours, tokenizer = family
  back, diff = exported_back(ours, tokenizer, tmp_path / "out")
  assert type(back) is type(hf) and diff <= TOL


@pytest.mark.parametrize("change, message", [
    (dict(layer_pattern="LX", sliding_window=8), "layer_pattern='LX': a string of L"),
    (dict(layer_pattern="LG"), "has local layers but model.sliding_window=0"),
    (dict(rope_local_theta=1e4), "rope_local_theta=10000.0 is for local layers"),
    (dict(final_softcap=30.0, xent="chunked"), "final_softcap with model.xent='chunked'"),
    (dict(attn_softcap=-1.0), "attn_softcap=-1.0 must be >= 0"),
])
def test_bad_gemma_settings_are_named(change, message):
  with pytest.raises(models.ConfigError, match=message):
    models.ModelConfig(**change)


def test_a_gemma_export_needs_an_integer_query_scalar(tmp_path):
  cfg = models.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           mlp_dim=48, mlp_activation="geglu", sandwich_norms=True,
                           norm_offset=1.0, embed_scale=True, attention_scale=0.3)
  with pytest.raises(ValueError, match="query_pre_attn_scalar is an integer"):
    models.export_hf(models.abstract_model(cfg), None, str(tmp_path / "out"))


def test_what_no_family_can_write_is_refused_not_changed():
  from models.families import config_to_hf
  moe_window = models.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2,
                                  num_kv_heads=1, mlp_dim=48, num_experts=4, qk_norm=True,
                                  sliding_window=8)
  with pytest.raises(ValueError, match="model.sliding_window=8.*cannot export"):
    config_to_hf(moe_window)  # Qwen3-MoE would write use_sliding_window=false
  # A Gemma with global layers only still names a window: transformers builds the sliding mask.
  gemma = models.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, mlp_dim=48, mlp_activation="geglu",
                             sandwich_norms=True, norm_offset=1.0, embed_scale=True,
                             max_seq_len=256)
  hf = config_to_hf(gemma)
  assert hf["sliding_window"] == 256 and hf["layer_types"] == ["full_attention"] * 2
  with pytest.raises(models.ConfigError, match="norm_offset=1.0 is for RMSNorm"):
    models.ModelConfig(norm="layer", norm_offset=1.0)
  with pytest.raises(ValueError, match="qkv_bias=False is not supported"):
    models.families.config_from_hf({"model_type": "qwen2_moe", "vocab_size": 64,
                                    "hidden_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "intermediate_size": 48,
                                    "qkv_bias": False})
