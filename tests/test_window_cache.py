"""A sliding-window decoder's KV cache is a ring of 2W slots (infer/kv_cache.py), not a
full-length cache: the Engine (float and int8 caches, one row and several), packed and
pieced prefill, and speculative decoding all give the tokens of the window-masked
full-length cache and of the cache-free reference decoder."""

import jax
import numpy as np
import pytest
from flax import nnx

from infer import Engine, SamplingParams, generate, kv_cache, packed_prefill
from infer.drafts import ModelDraft, PromptLookupDraft
from infer.speculative import SpeculativeDecoder
from models import ModelConfig, Transformer

WINDOW = 8
CFG = ModelConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=64, max_seq_len=128, sliding_window=WINDOW, init_std=0.3)


class _Tok:
  eos_id = None

  def decode(self, ids):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def model():
  return Transformer(CFG, nnx.Rngs(0))


def prompts(lengths, seed=1):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, CFG.vocab_size, size=(n,)).tolist() for n in lengths]


def full_length(monkeypatch):
  """Caches as before the ring: every position its own slot, the window only a mask."""
  monkeypatch.setattr(kv_cache, "ring_slots", lambda cfg: 0)


def run(model, batch, new=24, **kw):
  engine = Engine(model, _Tok(), 96, max_batch=len(batch), **kw)
  with jax.default_matmul_precision("highest"):
    out = engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True))
  return [r.token_ids for r in out]


def test_the_cache_holds_twice_the_window_not_the_context():
  assert kv_cache.slots_for(CFG, 96) == 2 * WINDOW
  cache = kv_cache.init(CFG, 3, 96)
  assert cache.k_LBSKH.shape == (2, 3, 2 * WINDOW, 2, 8)
  assert cache.k_LBSKH.nbytes * 2 == kv_cache.cache_bytes(CFG, 3, 96)
  assert kv_cache.cache_bytes(CFG, 3, 96) * 6 == kv_cache.cache_bytes(
      ModelConfig(**{**CFG.to_dict(), "sliding_window": 0}), 3, 96)
  # A context shorter than the ring keeps one slot per position.
  assert kv_cache.slots_for(CFG, 12) == 12


def test_one_row_matches_the_reference_decoder(model):
  (prompt,) = prompts([37])
  with jax.default_matmul_precision("highest"):
    want = generate(model, prompt, 24)
  assert run(model, [prompt]) == [want]


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_batch_matches_the_full_length_cache(model, monkeypatch, kv_dtype):
  # Prompts longer than the ring (pieced prefill), shorter than it, and padded beside others.
  batch = prompts([5, 21, 40])
  ring = run(model, batch, kv_dtype=kv_dtype)
  full_length(monkeypatch)
  assert run(model, batch, kv_dtype=kv_dtype) == ring


def test_packed_prefill_matches_the_reference(model):
  # Four short prompts pack into 16 tokens (not 4 x 16 padded), which the 16-slot ring holds.
  batch = prompts([3, 4, 5, 3], seed=2)
  with jax.default_matmul_precision("highest"):
    want = [generate(model, p, 24) for p in batch]
  assert run(model, batch) == want


def test_packed_prefill_refuses_a_row_longer_than_the_ring(model):
  cache = kv_cache.init(CFG, 2, 96)
  tokens_1P = np.ones((1, 20), np.int32)
  with pytest.raises(ValueError, match="ring of 16 slots"):
    packed_prefill.prefill_packed(model, tokens_1P, tokens_1P, tokens_1P, np.zeros(20, np.int32),
                                  np.zeros(2, np.int32), cache)


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_speculative_decoding_matches_the_engine(model, draft):
  (prompt,) = prompts([30], seed=3)
  prompt = prompt + prompt[:12]  # something for prompt lookup to find
  drafter = (PromptLookupDraft() if draft == "lookup"
             else ModelDraft(Transformer(CFG, nnx.Rngs(1))))
  spec = SpeculativeDecoder(model, drafter, gamma=3, max_seq_len=96)
  with jax.default_matmul_precision("highest"):
    got, stats = spec.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
  if draft == "lookup":  # its drafts were accepted: fewer target passes than tokens
    assert stats.target_passes < 40
  assert [got] == run(model, [prompt], new=40)
