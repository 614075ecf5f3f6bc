"""Unrolled decoding over per-layer weights (models/layer_weights.py) equals the layer scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer import Engine, SamplingParams, kv_cache
from infer.speculative import ModelDraft, PromptLookupDraft, SpeculativeDecoder
from models import ModelConfig, Transformer, layer_weights
from tests.test_kv_cache import CFG, MOE, CharTokenizer

TOL = 1e-5  # float32; unrolling only changes how XLA fuses the same ops
PROMPTS = [[5, 9, 2], list(range(1, 20)), [40], [7, 7, 8, 7, 7, 8, 7]]
KINDS = {"dense": {}, "moe": MOE, "sliding_window": dict(sliding_window=5),
         "prefix_lm": dict(arch="prefix_lm"),
         "relative": dict(position="relative", relative_buckets=8, relative_max_distance=16)}


@pytest.fixture(scope="module", params=list(KINDS))
def model(request):
  return Transformer(ModelConfig(**CFG, **KINDS[request.param]), nnx.Rngs(0))


def _same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=TOL)


@pytest.mark.parametrize("max_batch, kv_dtype", [(4, None), (1, None), (4, "int8")],
                         ids=["batch", "one_row", "int8"])
def test_engine_unrolled_equals_scanned(model, max_batch, kv_dtype):
  requests = [SamplingParams(max_tokens=12, logprobs=True),
              SamplingParams(max_tokens=9, logprobs=True, temperature=1.0, top_k=20, seed=3),
              SamplingParams(max_tokens=5, logprobs=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, logprobs=True, stop_token_ids=[7])]
  out = {}
  for unroll in (False, True):
    engine = Engine(model, CharTokenizer(), max_batch=max_batch, kv_dtype=kv_dtype,
                    unroll_layers=unroll)
    assert isinstance(engine.weights(), layer_weights.LayerWeights) == unroll
    out[unroll] = engine.generate(PROMPTS, requests)
  _same(out[False], out[True])


def test_forward_writes_the_cache_as_the_scan_does(model):
  """kv_cache.forward itself: a prefill, then decode steps at a narrow width."""
  graphdef, state = nnx.split(model)
  unrolled = layer_weights.merge(graphdef, layer_weights.unstack(state))
  assert layer_weights.is_unrolled(unrolled) and not layer_weights.is_unrolled(model)
  step = jax.jit(lambda m, t, s, c, w: kv_cache.forward(m, t, s, c, width=w),
                 static_argnums=(4,))
  results = {}
  for name, m in (("scan", model), ("unrolled", unrolled)):
    cache = kv_cache.init(model.cfg, 3, 32)
    tokens_BT = jnp.asarray([PROMPTS[1][:8], PROMPTS[0] + [0] * 5, [9] * 8], jnp.int32)
    segment_ids_BT = jnp.asarray([[1] * 8, [1] * 3 + [0] * 5, [1] * 8], jnp.int32)
    logits, cache = step(m, tokens_BT, segment_ids_BT, cache, None)
    steps = [logits]
    for i in range(3):
      logits, cache = step(m, jnp.asarray([[3 + i], [4], [5]], jnp.int32),
                           jnp.asarray([[1], [1], [0]], jnp.int32), cache, 16)
      steps.append(logits)
    results[name] = (steps, cache)
  (steps_a, cache_a), (steps_b, cache_b) = results["scan"], results["unrolled"]
  for a, b in zip(steps_a, steps_b):
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
  for field in ("k_LBSKH", "v_LBSKH"):
    np.testing.assert_allclose(getattr(cache_a, field), getattr(cache_b, field), rtol=0, atol=TOL)
  for field in ("segment_ids_BS", "positions_BS", "lengths_B"):
    np.testing.assert_array_equal(getattr(cache_a, field), getattr(cache_b, field))


@pytest.mark.parametrize("kind", ["lookup", "model"])
def test_speculative_unrolled_equals_scanned(kind):
  """Prompt lookup's rounds on the device, and a draft model's rounds driven from the host."""
  model = Transformer(ModelConfig(**CFG), nnx.Rngs(0))
  small = Transformer(ModelConfig(**dict(CFG, num_layers=1)), nnx.Rngs(1))
  prompt = [7, 7, 8, 7, 7, 8, 7, 3, 7, 7]
  params = SamplingParams(max_tokens=16, logprobs=True, temperature=1.0, seed=5)
  out = {}
  for unroll in (False, True):
    draft = PromptLookupDraft(max_ngram=2, min_ngram=1) if kind == "lookup" else ModelDraft(small)
    decoder = SpeculativeDecoder(model, draft, gamma=3, unroll_layers=unroll)
    assert isinstance(decoder.weights(), layer_weights.LayerWeights) == unroll
    out[unroll] = decoder.generate(prompt, params)
  (ids_a, stats_a), (ids_b, stats_b) = out[False], out[True]
  assert ids_a == ids_b and stats_a.gammas == stats_b.gammas
  np.testing.assert_allclose(stats_a.logprobs, stats_b.logprobs, rtol=0, atol=TOL)


def test_new_state_is_unstacked_again():
  """A rollout assigns the policy's new weights to `engine.state`; the next batch reads them."""
  cfg = ModelConfig(**CFG)
  old, new = Transformer(cfg, nnx.Rngs(0)), Transformer(cfg, nnx.Rngs(1))
  params = SamplingParams(max_tokens=8, logprobs=True)
  engine = Engine(old, CharTokenizer(), max_batch=2, unroll_layers=True)
  before = engine.generate(PROMPTS[:2], params)
  engine.state = nnx.split(new)[1]
  fresh = Engine(new, CharTokenizer(), max_batch=2, unroll_layers=True)
  after = engine.generate(PROMPTS[:2], params)
  assert [r.token_ids for r in after] != [r.token_ids for r in before]  # the new weights ran
  _same(after, fresh.generate(PROMPTS[:2], params))
  decoder = SpeculativeDecoder(old, PromptLookupDraft(), gamma=2, unroll_layers=True)
  stale = decoder.generate(PROMPTS[1], params)[0]
  decoder.state = nnx.split(new)[1]
  fresh_decoder = SpeculativeDecoder(new, PromptLookupDraft(), gamma=2, unroll_layers=True)
  assert decoder.generate(PROMPTS[1], params)[0] == fresh_decoder.generate(PROMPTS[1], params)[0]
  assert fresh_decoder.generate(PROMPTS[1], params)[0] != stale


def test_misuse_is_named():
  model = Transformer(ModelConfig(**CFG), nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  unrolled = layer_weights.merge(graphdef, layer_weights.unstack(state))
  with pytest.raises(TypeError, match="unstacked for decoding"):
    unrolled(jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="no 'blocks' stack"):
    layer_weights.unstack(nnx.State({"embed_VD": state["embed_VD"]}))
