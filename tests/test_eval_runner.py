"""The evaluation runner survives models that answer with nothing, loop, or go on forever,
and conversations the engine cannot take; the scorers take enormous text."""

import pytest
from flax import nnx

from align.evals import refusal
from align.evals.helpful import normalize_answer
from align.evals.runner import ChatModel, is_degenerate, output_counts
from models.config import ModelConfig
import deps
from models.pretrained import load_pretrained_tokenizer
from models.registry import create_model


@pytest.fixture(scope="module")
def tiny_chat():
  """A random 2-layer decoder with SmolLM2's tokenizer and chat template: it babbles."""
  tok = load_pretrained_tokenizer(deps.smollm())
  cfg = ModelConfig(vocab_size=49152, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=256, tie_embeddings=True)
  return create_model(cfg, nnx.Rngs(0)), tok


def test_looping_text_is_flagged():
  assert is_degenerate("la la la la " * 30)
  assert is_degenerate("a" * 300)
  assert not is_degenerate("")
  assert not is_degenerate("The capital of France is Paris. It lies on the Seine, and "
                           "about two million people live in the city proper.")


def test_babbling_model_is_capped_clipped_and_counted(tiny_chat):
  model, tok = tiny_chat
  chat = ChatModel(model, tok, max_new_tokens=24, batch_size=4, max_prompt_tokens=64,
                   max_chars=20)
  long_question = "Please answer this. " * 200  # far over max_prompt_tokens: its end is kept
  convs = [[{"role": "user", "content": "Hi"}],
           [{"role": "user", "content": long_question}],
           [{"role": "robot", "content": "bad role"}],          # refused, not raised
           [{"role": "user", "content": None}]]
  out = chat.respond(convs)
  assert [r.finish_reason for r in out[2:]] == ["error", "error"]
  assert all(r.text == "" and r.error for r in out[2:])
  assert len(chat.prompt_ids(convs[1])) == 64
  for r in out[:2]:
    assert r.finish_reason in ("length", "stop") and len(r.text) <= 20
  counts = output_counts(out)
  assert counts["responses"] == 4 and counts["errors"] == 2
  assert counts["clipped_outputs"] == sum(r.clipped for r in out)
  assert chat.respond(convs) == out  # greedy: the same answers again


def test_scorers_take_enormous_and_empty_text():
  huge = "word " * 200_000
  assert refusal.string_refusal(huge) is False
  assert refusal.string_refusal("") is True  # nothing was provided
  assert refusal.is_abstention("") is False
  assert normalize_answer(huge[:50]) == " ".join(["word"] * 10)
