"""Each decoder family (benchmarks/family_parity.py's random tiny models) quantizes weight-only
to INT8 and INT4 (RTN, infer/quant) and serves through the quantized Engine: the quantized
forward equals the float forward over the dequantized weights, and the Engine's greedy tokens
(its KV cache on the quantized weights) equal the cache-free reference decoder's."""

import jax
import numpy as np
import pytest
from flax import nnx

import deps

deps.require("torch")
deps.require("transformers")

from benchmarks.family_parity import FAMILIES, VOCAB, logits, make_family  # noqa: E402
from infer import Engine, SamplingParams, generate  # noqa: E402
from infer.quant import QArray, default_rules, quantize_model  # noqa: E402
from models import load_pretrained  # noqa: E402
from models.rope import BY_LENGTH  # noqa: E402

TOL = 1e-4  # float32: the two forwards differ in summation order only


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param.replace(".", "_")))
  make_family(request.param, directory)
  return directory


def dequantized(model):
  """A float copy of `model` whose weights are its QArrays' values."""
  graphdef, state = nnx.split(model)
  plain = jax.tree.map(lambda v: v.dequantize() if isinstance(v, QArray) else v, state,
                       is_leaf=lambda v: isinstance(v, QArray))
  return nnx.merge(graphdef, plain)


def test_quantized_family_computes_and_serves_its_weights(family_dir):
  tokens_BT = np.random.default_rng(0).integers(3, VOCAB, size=(2, 24), dtype=np.int32)
  for fmt in ("int8", "int4-g16"):
    model, tokenizer = load_pretrained(family_dir)
    plan = quantize_model(model, default_rules(fmt, embeddings="auto"))
    assert plan, fmt
    diff = np.max(np.abs(logits(model, tokens_BT) - logits(dequantized(model), tokens_BT)))
    assert diff <= TOL, (fmt, diff)
  # The INT4 model through the Engine (its prefill and decode steps on the quantized weights),
  # against the cache-free reference decoder; where RoPE depends on the length (dynamic,
  # longrope) a cached key keeps its rotation and a recomputed one does not, so the reference
  # is the dequantized weights' Engine.
  prompt = tokens_BT[0, :13].tolist()
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  with jax.default_matmul_precision("highest"):
    (out,) = Engine(model, tokenizer, 32, 1).generate([prompt], params)
    if model.cfg.rope_scaling in BY_LENGTH:
      (want,) = Engine(dequantized(model), tokenizer, 32, 1).generate([prompt], params)
      assert out.token_ids == want.token_ids
    else:
      assert out.token_ids == generate(model, prompt, 8)
