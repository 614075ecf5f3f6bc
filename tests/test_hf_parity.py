"""Hugging Face interop: random transformers Llamas load with identical logits, and export back."""

import json
import os

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from benchmarks.family_parity import write_tokenizer  # noqa: E402

import models  # noqa: E402
from models import hf_io  # noqa: E402

TOL = 1e-4  # float32 on both sides; differences are summation order only
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")

CASES = {
    # GQA, untied, odd vocabulary, split over several safetensors shards.
    "gqa_untied_sharded": dict(vocab=997, heads=4, kv=2, theta=10000.0, tied=False, shard="40KB"),
    # Multi-head attention with tied embeddings and a larger rope base.
    "mha_tied": dict(vocab=1013, heads=4, kv=4, theta=100000.0, tied=True),
    # One KV head and head_dim != d_model / heads.
    "mqa_tied_wide_heads": dict(vocab=997, heads=4, kv=1, head_dim=32, theta=10000.0, tied=True),
    # Deeper, 6 query heads over 2 KV heads, untied, rope base 1e5.
    "gqa3_untied": dict(vocab=997, hidden=96, inter=160, layers=3, heads=6, kv=2,
                        theta=100000.0, tied=False),
}


def _write_tokenizer(directory, vocab_size):
  """A word-level tokenizer w3..wN with <s>/</s> specials and a chat template."""
  write_tokenizer(directory, vocab_size, TEMPLATE)


def make_hf_checkpoint(directory, vocab=997, hidden=64, inter=96, layers=2, heads=4, kv=2,
                       head_dim=None, theta=10000.0, tied=False, shard=None, seed=0):
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rope_theta=theta,
      tie_word_embeddings=tied, max_position_embeddings=128, rms_norm_eps=1e-5,
      # Large weights make attention far from uniform, so a RoPE or head-layout
      # mistake moves the logits by much more than TOL.
      initializer_range=0.2, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # non-trivial norm scales, so a swapped norm mapping shows up
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
  kwargs = {"max_shard_size": shard} if shard else {}
  model.save_pretrained(directory, **kwargs)
  _write_tokenizer(directory, vocab)
  return model


def _tokens(vocab, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, size=(2, 24), dtype=np.int32)


def _torch_logits(model, tokens_BT):
  with torch.no_grad():
    return model(torch.from_numpy(tokens_BT.astype(np.int64))).logits.float().numpy()


def _max_diff(ours, tokens_BT, reference_BTV):
  with jax.default_matmul_precision("highest"):  # no TF32/bf16 passes on accelerators
    logits_BTV = np.asarray(ours(jnp.asarray(tokens_BT)))
  assert logits_BTV.shape == reference_BTV.shape
  return float(np.max(np.abs(logits_BTV - reference_BTV)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
  spec = CASES[case]
  hf_model = make_hf_checkpoint(tmp_path, **spec)
  if spec.get("shard"):
    assert os.path.exists(tmp_path / hf_io.INDEX_FILE), "expected a sharded checkpoint"
  model, tok = models.load_pretrained(str(tmp_path))
  cfg = model.cfg
  assert (cfg.vocab_size, cfg.num_kv_heads, cfg.tie_embeddings) == (
      spec["vocab"], spec["kv"], spec["tied"])
  assert cfg.rope_theta == spec["theta"]
  assert hasattr(model, "unembed_DV") != spec["tied"]
  tokens_BT = _tokens(spec["vocab"])
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model, tokens_BT)) <= TOL
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  assert tok.encode("w5 w17 w900") == [5, 17, 900]


@pytest.mark.parametrize("case", ["gqa3_untied", "mqa_tied_wide_heads"])
def test_export_round_trip(tmp_path, case):
  spec = CASES[case]
  make_hf_checkpoint(tmp_path / "src", **spec)
  model, tok = models.load_pretrained(str(tmp_path / "src"))
  out = tmp_path / "exported"
  models.export_hf(model, tok, str(out))

  tokens_BT = _tokens(spec["vocab"], seed=1)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  assert type(hf_model).__name__ == "LlamaForCausalLM"
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model.eval(), tokens_BT)) <= TOL
  # Our own loader reads the export back bit for bit.
  again, tok2 = models.load_pretrained(str(out))
  with jax.default_matmul_precision("highest"):
    reference_BTV = np.asarray(model(jnp.asarray(tokens_BT)))
  assert _max_diff(again, tokens_BT, reference_BTV) == 0.0

  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  text = "w5 w17 w900 w3"
  assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
  messages = [{"role": "user", "content": "w4 w5"}]
  assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
      tok.apply_chat_template(messages)
  assert (hf_tok.bos_token, hf_tok.eos_token) == ("<s>", "</s>")
  assert (tok2.bos_id, tok2.eos_id, tok2.chat_template) == (tok.bos_id, tok.eos_id, TEMPLATE)


def test_bfloat16_checkpoint_and_dtype_overrides(tmp_path):
  hf_model = make_hf_checkpoint(tmp_path / "f32", vocab=101)
  hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # weights only, no tokenizer
  with pytest.warns(UserWarning, match="no tokenizer.json"):
    model, tok = models.load_pretrained(str(tmp_path / "bf16"))  # keeps the stored dtype
  assert tok is None
  assert (model.cfg.param_dtype, model.cfg.dtype) == ("bfloat16", "bfloat16")
  assert model.embed_VD[...].dtype == jnp.bfloat16
  with pytest.warns(UserWarning, match="no tokenizer.json"):
    model, _ = models.load_pretrained(str(tmp_path / "bf16"), dtype="float32",
                                      param_dtype="float32")
  assert model.blocks.attn.wq_DNH[...].dtype == jnp.float32
  # Reference: transformers upcasting the same bf16 file (exact), with its RoPE
  # buffers computed in f32 (an in-place .to(bf16).float() would round those).
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"),
                                                                dtype=torch.float32).eval()
  tokens_BT = _tokens(101)
  assert _max_diff(model, tokens_BT, _torch_logits(reference, tokens_BT)) <= TOL


def test_load_onto_mesh(tmp_path):
  from parallel import make_mesh
  hf_model = make_hf_checkpoint(tmp_path, vocab=101)
  mesh = make_mesh({})
  model, _ = models.load_pretrained(str(tmp_path), mesh=mesh)
  assert isinstance(model.blocks.mlp.up_DF[...].sharding, jax.sharding.NamedSharding)
  tokens_BT = _tokens(101)
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model, tokens_BT)) <= TOL


def test_export_is_all_or_nothing(tmp_path, monkeypatch):
  make_hf_checkpoint(tmp_path / "src", vocab=101, layers=1)
  model, tok = models.load_pretrained(str(tmp_path / "src"))
  parent = tmp_path / "exports"
  parent.mkdir()

  def broken_save(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(hf_io, "save_file", broken_save)
  with pytest.raises(OSError, match="disk full"):
    models.export_hf(model, tok, str(parent / "out"))
  assert os.listdir(parent) == []  # neither the target nor a temp directory is left
  monkeypatch.undo()

  (parent / "out").mkdir()
  (parent / "out" / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="overwrite"):
    models.export_hf(model, tok, str(parent / "out"))
  models.export_hf(model, tok, str(parent / "out"), overwrite=True)
  assert sorted(os.listdir(parent)) == ["out"]
  assert "keep.txt" not in os.listdir(parent / "out")
  assert os.path.exists(parent / "out" / "model.safetensors")


def test_missing_path_names_it(tmp_path):
  missing = str(tmp_path / "no-such-model")
  with pytest.raises(FileNotFoundError, match="no-such-model"):
    models.load_pretrained(missing)


def test_directory_without_config_or_weights(tmp_path):
  make_hf_checkpoint(tmp_path / "full", vocab=101, layers=1)
  no_config = tmp_path / "no_config"
  no_config.mkdir()
  os.link(tmp_path / "full" / "model.safetensors", no_config / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.load_pretrained(str(no_config))
  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  os.link(tmp_path / "full" / "config.json", no_weights / "config.json")
  with pytest.raises(FileNotFoundError, match="safetensors"):
    models.load_pretrained(str(no_weights))


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["PhiForCausalLM"], model_type="phi"), "PhiForCausalLM"),
    (dict(sliding_window=4096), "sliding_window=4096 is not supported"),
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     "only LlamaForCausalLM .*BERT encoders .*T5ForConditionalGeneration"),
    (dict(rope_scaling={"rope_type": "su", "factor": 8.0}), "rope scaling type 'su'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                           "original_max_position_embeddings": 16}),
     "short_factors / long_factors go together"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs original_max_len"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_config_is_rejected(tmp_path, change, message):
  make_hf_checkpoint(tmp_path, vocab=101, layers=1)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  config.update(change)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=message):
    models.load_pretrained(str(tmp_path))


def test_unexpected_tensor_is_rejected(tmp_path):
  from safetensors.numpy import load_file, save_file
  make_hf_checkpoint(tmp_path, vocab=101, layers=1)
  tensors = load_file(tmp_path / "model.safetensors")
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="q_proj.bias"):
    models.load_pretrained(str(tmp_path))
