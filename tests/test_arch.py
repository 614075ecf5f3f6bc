"""Architectures beyond decoder-only: config errors, masks, and that every model is built
from the same shared modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ConfigError, ModelConfig, create_model, param_count
from models.attention import attention
from models.blocks import Block
from models.layers import MLP, Attention, LayerNorm, RMSNorm
from models.moe import MoE
from models.positions import RelativePositionBias, relative_buckets

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
            max_seq_len=32)
BERT = dict(TINY, arch="encoder", norm="layer", norm_position="post", mlp_activation="gelu",
            use_bias=True, position="learned", type_vocab_size=2, tie_embeddings=True,
            num_classes=3)
T5 = dict(TINY, arch="encoder_decoder", position="relative", mlp_activation="geglu",
          attention_scale=1.0, num_decoder_layers=3, relative_buckets=8,
          relative_max_distance=16)
HYBRID = dict(TINY, arch="prefix_lm")


@pytest.mark.parametrize("values, message", [
    (dict(T5, decoder_vocab_size=65), "mismatched vocabularies: model.vocab_size=64 .*"
                                      "decoder_vocab_size=65"),
    (dict(TINY, num_decoder_layers=2), "num_decoder_layers=2 is only for arch='encoder_decoder'"),
    (dict(TINY, arch="encoder_only"), "model.arch='encoder_only'; choose one of"),
    (dict(T5, relative_buckets=7), "relative_buckets=7 must be an even integer"),
    (dict(T5, relative_max_distance=4), "relative_max_distance=4 must exceed"),
    (dict(TINY, type_vocab_size=2), "type_vocab_size and model.num_classes are encoder options"),
    (dict(TINY, arch="encoder", num_experts=4), "mixture-of-experts blocks are supported in"),
    (dict(BERT, num_heads=5), "num_heads=5 does not divide model.d_model=32"),
    (dict(T5, num_kv_heads=3), "num_heads=4 is not a multiple of model.num_kv_heads=3"),
    (dict(BERT, sliding_window=4), "sliding_window is for arch='decoder'"),
    (dict(HYBRID, sliding_window=4), "sliding_window is for arch='decoder'"),
    (dict(TINY, num_experts=4, mlp_activation="gelu"), "MoE experts are SwiGLU without biases"),
    (dict(TINY, norm_position="middle"), "norm_position='middle'"),
])
def test_inconsistent_configs_fail_naming_the_problem(values, message):
  with pytest.raises(ConfigError, match=message):
    ModelConfig(**values)


def _module_types(model):
  return {type(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


@pytest.mark.parametrize("values", [TINY, HYBRID, BERT, T5, dict(TINY, num_experts=4, top_k=2)])
def test_every_architecture_is_built_from_the_shared_modules(values):
  """The reviewer's check as a test: no architecture brings its own attention, MLP or norm."""
  cfg = ModelConfig(**values)
  model = create_model(cfg, nnx.Rngs(0))
  shared = {Block, Attention, MLP, MoE, RMSNorm, LayerNorm, RelativePositionBias, type(model)}
  assert _module_types(model) <= shared, _module_types(model) - shared
  assert {Block, Attention} <= _module_types(model)


@pytest.mark.parametrize("values", [TINY, dict(TINY, tie_embeddings=True)])
def test_closed_form_param_count_matches_the_model(values):
  cfg = ModelConfig(**values)
  assert cfg.num_params() == param_count(cfg)
  with pytest.raises(ValueError, match=r"models.param_count\(cfg\)"):
    ModelConfig(**BERT).num_params()


def _logits(model, tokens, **kw):
  return np.asarray(model(jnp.asarray(tokens), **kw))


def test_prefix_lm_prompt_is_bidirectional_and_generation_causal():
  model = create_model(ModelConfig(**HYBRID), nnx.Rngs(1))
  tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
  prefix = jnp.asarray([[1, 1, 1, 1, 0, 0, 0, 0]])
  base = _logits(model, tokens, prefix_BT=prefix)
  later_prompt = tokens.copy()
  later_prompt[0, 3] = 40  # the last prompt token: earlier prompt positions see it
  changed = _logits(model, later_prompt, prefix_BT=prefix)
  assert np.abs(changed[0, 0] - base[0, 0]).max() > 1e-4
  later_target = tokens.copy()
  later_target[0, 6] = 40  # a generated token: nothing before it may see it
  changed = _logits(model, later_target, prefix_BT=prefix)
  np.testing.assert_array_equal(changed[0, :6], base[0, :6])
  # An empty prefix is exactly the causal decoder.
  causal = _logits(model, tokens)
  np.testing.assert_allclose(_logits(model, tokens, prefix_BT=jnp.zeros_like(prefix)), causal,
                             atol=1e-6)


def test_prefix_mask_blockwise_equals_naive():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 24, 4, 8))
  k, v = (jax.random.normal(kk, (2, 24, 2, 8)) for kk in keys[1:])
  seg = jnp.asarray([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24])
  prefix = jnp.asarray([[1] * 4 + [0] * 6 + [1] * 3 + [0] * 11, [1] * 12 + [0] * 12])
  args = dict(q_segment_ids_BT=seg, kv_segment_ids_BS=seg, kv_prefix_BS=prefix)
  naive = attention(q, k, v, impl="naive", **args)
  block = attention(q, k, v, impl="blockwise", block_q=8, block_kv=8, **args)
  np.testing.assert_allclose(block, naive, atol=1e-5)
  grad = lambda impl: jax.grad(lambda q: jnp.sum(attention(  # noqa: E731
      q, k, v, impl=impl, block_q=8, block_kv=8, **args) ** 2))(q)
  np.testing.assert_allclose(grad("blockwise"), grad("naive"), atol=1e-4)


def test_encoder_is_bidirectional_and_ignores_padding():
  model = create_model(ModelConfig(**BERT), nnx.Rngs(2))
  tokens = jnp.asarray([[3, 4, 5, 6, 0, 0]])
  mask = jnp.asarray([[1, 1, 1, 1, 0, 0]])
  base = np.asarray(model.encode(tokens, segment_ids_BT=mask))
  changed = np.asarray(model.encode(tokens.at[0, 3].set(9), segment_ids_BT=mask))
  assert np.abs(changed[0, 0] - base[0, 0]).max() > 1e-4  # the first token sees the last
  other_pad = np.asarray(model.encode(tokens.at[0, 5].set(9), segment_ids_BT=mask))
  np.testing.assert_allclose(other_pad[0, :4], base[0, :4], atol=1e-6)
  emb = np.asarray(model.embed_sentences(tokens, mask))
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-6)
  assert model.classify(tokens, mask).shape == (1, 3)


def test_relative_buckets_match_transformers():
  from transformers.models.t5.modeling_t5 import T5Attention
  import torch
  rel = np.arange(-300, 300)[None, :]
  for bidirectional in (True, False):
    ours = np.asarray(relative_buckets(jnp.asarray(rel), bidirectional=bidirectional,
                                       num_buckets=32, max_distance=128))
    theirs = T5Attention._relative_position_bucket(torch.tensor(rel), bidirectional=bidirectional,
                                                   num_buckets=32, max_distance=128).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_encoder_decoder_rejects_mismatched_batches():
  model = create_model(ModelConfig(**T5), nnx.Rngs(3))
  with pytest.raises(ValueError, match="decoder batch 2 != encoder batch 1"):
    model(jnp.zeros((2, 4), jnp.int32), enc_inputs_BS=jnp.zeros((1, 6), jnp.int32))
  logits = model(jnp.zeros((2, 4), jnp.int32), enc_inputs_BS=jnp.ones((2, 6), jnp.int32))
  assert logits.shape == (2, 4, 64) and bool(jnp.all(jnp.isfinite(logits)))


def test_prefix_input_refused_by_a_plain_decoder():
  model = create_model(ModelConfig(**TINY), nnx.Rngs(0))
  with pytest.raises(ValueError, match="prefix_BT is the prefix-LM's input"):
    model(jnp.zeros((1, 4), jnp.int32), prefix_BT=jnp.ones((1, 4), jnp.int32))


@pytest.mark.parametrize("values", [BERT, T5])
def test_int8_quantization_applies_unchanged(values):
  """The quantizer finds every projection by its name; no per-architecture rules."""
  from infer.quant.quantize import quantize_model
  from models.quant.rules import default_rules
  cfg = ModelConfig(**values)
  model = create_model(cfg, nnx.Rngs(4))
  tokens = jnp.arange(12).reshape(2, 6) % cfg.vocab_size
  kw = dict(enc_inputs_BS=tokens[:, ::-1]) if cfg.arch == "encoder_decoder" else {}
  reference = np.asarray(model(tokens, **kw))
  plan = quantize_model(model, default_rules("int8"))
  stacks = ("enc_blocks", "blocks") if cfg.arch == "encoder_decoder" else ("blocks",)
  for stack in stacks:
    assert f"{stack}/attn/wq_DNH" in plan and f"{stack}/mlp/down_FD" in plan
  if cfg.arch == "encoder_decoder":
    assert "blocks/cross_attn/wk_DKH" in plan
  # Per-channel int8 of N(0, 0.02) weights: logits move by well under 2% of their range.
  moved = np.abs(np.asarray(model(tokens, **kw)) - reference).max()
  assert 0 < moved < 0.02 * np.abs(reference).max()


def test_engine_serves_a_prefix_lm_with_a_bidirectional_prompt():
  """KV-cached greedy generation == recomputing the whole sequence with the prompt as prefix."""
  from infer.engine import Engine
  from infer.sampling import SamplingParams

  class Ids:  # token ids in, token ids out: no text needed
    eos_id = None
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  model = create_model(ModelConfig(**HYBRID), nnx.Rngs(5))
  prompt = [3, 9, 4, 17, 8]
  got = Engine(model, Ids(), max_seq_len=32, max_batch=2).generate(
      [prompt, prompt[:3]], SamplingParams(max_tokens=6, temperature=0.0))
  for result, p in zip(got, (prompt, prompt[:3])):
    ids = list(p)
    for _ in range(6):
      prefix = jnp.asarray([[1] * len(p) + [0] * (len(ids) - len(p))])
      ids.append(int(jnp.argmax(model(jnp.asarray([ids]), prefix_BT=prefix)[0, -1])))
    assert result.token_ids == ids[len(p):]
  # The prefix mask matters: the same prompt read causally gives other logits.
  logits_prefix = model(jnp.asarray([prompt]), prefix_BT=jnp.ones((1, 5), jnp.int32))
  assert np.abs(np.asarray(logits_prefix - model(jnp.asarray([prompt])))).max() > 1e-4


def test_engines_refuse_architectures_they_cannot_serve():
  from infer.engine import Engine
  from infer.serving import PagedEngine
  with pytest.raises(ValueError, match="Engine serves arch .* not 'encoder'"):
    Engine(create_model(ModelConfig(**BERT), nnx.Rngs(0)), None)
  with pytest.raises(ValueError, match="PagedEngine serves arch .* not 'prefix_lm'"):
    PagedEngine(create_model(ModelConfig(**HYBRID), nnx.Rngs(0)), None)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_relative_positions_depend_on_offsets_only(arch):
  """A sequence packed second in a row (positions restarting at 0) reads as it does alone."""
  cfg = ModelConfig(**dict(TINY, arch=arch, position="relative", relative_buckets=8,
                           relative_max_distance=16))
  model = create_model(cfg, nnx.Rngs(6))
  run = model.encode if arch == "encoder" else model
  alone = np.asarray(run(jnp.asarray([[4, 8, 15, 16, 23, 42]])))
  packed = jnp.asarray([[9, 9, 9, 4, 8, 15, 16, 23, 42]])
  positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4, 5]])
  segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2, 2]])
  np.testing.assert_allclose(np.asarray(run(packed, positions, segments))[:, 3:], alone,
                             atol=1e-5)
  model.rel_bias.table_RN[...] = jnp.zeros_like(model.rel_bias.table_RN[...])
  assert np.abs(np.asarray(run(jnp.asarray([[4, 8, 15, 16, 23, 42]]))) - alone).max() > 1e-4


def test_kv_cached_decoder_with_relative_positions_matches_full_forward():
  from infer.engine import Engine
  from infer.sampling import SamplingParams

  class Ids:
    eos_id = None
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  cfg = ModelConfig(**dict(TINY, position="relative", relative_buckets=8, relative_max_distance=16))
  model = create_model(cfg, nnx.Rngs(7))
  prompt = [5, 1, 9, 2]
  got = Engine(model, Ids(), max_seq_len=32, max_batch=1).generate(
      prompt, SamplingParams(max_tokens=5, temperature=0.0))
  ids = list(prompt)
  for _ in range(5):
    ids.append(int(jnp.argmax(model(jnp.asarray([ids]))[0, -1])))
  assert got[0].token_ids == ids[len(prompt):]


def test_tools_that_assume_a_llama_refuse_other_architectures():
  from infer.quant.gptq import gptq_quantize
  from models.quant.rules import default_rules
  from infer.sampling import generate
  from models import export_hf
  hybrid = create_model(ModelConfig(**HYBRID), nnx.Rngs(0))
  with pytest.raises(ValueError, match="export_hf writes Hugging Face decoder checkpoints; .*prefix_lm"):
    export_hf(hybrid, None, "/nonexistent/out")
  with pytest.raises(ValueError, match="GPTQ calibrates Llama-style decoders.*method='rtn'"):
    gptq_quantize(create_model(ModelConfig(**BERT), nnx.Rngs(0)), default_rules("int8"),
                  np.zeros((1, 8), np.int32))
  with pytest.raises(ValueError, match="generate continues decoder-only models; arch='encoder'"):
    generate(create_model(ModelConfig(**BERT), nnx.Rngs(0)), [1, 2], 2)
  from infer.serving import PagedEngine
  relative = ModelConfig(**dict(TINY, position="relative", relative_buckets=8,
                                relative_max_distance=16))
  with pytest.raises(ValueError, match="PagedEngine has no relative position bias"):
    PagedEngine(create_model(relative, nnx.Rngs(0)), None)
  post = ModelConfig(**dict(TINY, norm_position="post"))  # not the closed form's shape
  with pytest.raises(ValueError, match="closed form for Llama-shaped decoders"):
    post.num_params()


def test_cache_free_generate_reads_a_prefix_lm_prompt_bidirectionally():
  from infer.engine import Engine
  from infer.sampling import SamplingParams, generate

  class Ids:
    eos_id = None
    decode = staticmethod(lambda ids: "")

  model = create_model(ModelConfig(**HYBRID), nnx.Rngs(5))
  prompt = [3, 9, 4, 17, 8]
  cached = Engine(model, Ids(), max_seq_len=32, max_batch=1).generate(
      prompt, SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
  assert generate(model, prompt, 6) == cached


@pytest.mark.parametrize("arch", ["encoder_decoder", "prefix_lm"])
def test_plan_compiles_the_step_with_each_architectures_batch(arch):
  from experiments.arch_compare import get_config
  from train.plan.aot import abstract_batch, compile_memory
  config = get_config(arch)
  config.model.num_layers, config.model.d_model, config.batch_size = 1, 32, 2
  if arch == "encoder_decoder":
    config.model.num_decoder_layers = 1
    assert abstract_batch(config, ModelConfig(**T5))["enc_inputs"].shape == (2, 64)
  assert compile_memory(config, {"data": 1}, "data_parallel")["peak"] > 0
