"""load_pretrained(gguf, quantized=True): Q4_0/Q4_1/Q8_0 kept as QArrays, same values as the float load."""

import numpy as np
import pytest

import gguf
import jax
import jax.numpy as jnp
from flax import nnx
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize
from tokenizers import pre_tokenizers

import deps
import models
from infer import Engine, SamplingParams
from infer.quant.quantize import weight_bytes
from models.quant.qarray import QArray

# Same weight values in both loads; only the summation order differs (QArray sums
# the two nibble planes as separate matmuls), float32 over 30 layers. Measured
# ~1e-4 on logits of magnitude ~40; the float GGUF load vs transformers uses 1e-3 too.
LOGIT_TOL = 1e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _params(model) -> dict:
  return {path: var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _logits(model, tokens_BT):
  with jax.default_matmul_precision("highest"):  # no TF32/bf16 passes on accelerators
    return np.asarray(model(jnp.asarray(tokens_BT, jnp.int32)))


def _assert_same_values(quant, float_, paths):
  for path in paths:
    q, f = quant[path], np.asarray(float_[path])
    assert isinstance(q, QArray), path
    np.testing.assert_array_equal(np.asarray(q.dequantize()), f, err_msg=str(path))


# ---- SmolLM2-135M-Instruct: projections Q4_1, tied token_embd Q8_0 ----

@pytest.fixture(scope="module")
def smollm():
  path = deps.smollm()
  float_model, tok = models.load_pretrained(path)
  quant_model, _ = models.load_pretrained(path, quantized=True)
  return float_model, quant_model, tok


def test_smollm_weights_keep_their_gguf_formats_and_values(smollm):
  float_model, quant_model, _ = smollm
  quant, float_ = _params(quant_model), _params(float_model)
  formats = {path[-1]: v.fmt.name for path, v in quant.items() if isinstance(v, QArray)}
  assert formats == {**{n: "int4-g32-asym" for n in ("wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD",
                                                       "gate_DF", "up_DF", "down_FD")},
                     "embed_VD": "int8-g32"}
  assert all(not isinstance(v, QArray) for path, v in quant.items() if path[-1] == "scale")
  q = quant[("blocks", "attn", "wq_DNH")]
  assert q.codes.shape == (30, 576 // 32, 16, 576) and q.codes.dtype == jnp.uint8
  assert q.shape == float_[("blocks", "attn", "wq_DNH")].shape
  # Three layers (first, middle, last) of every projection, and the embedding: bit-exact.
  for path, value in quant.items():
    if isinstance(value, QArray) and value.codes.ndim == 4:
      sliced = {path: QArray(value.codes[::14], value.scale[::14], value.offset[::14],
                             value.fmt, value.letters, value.in_letters, value.dims)}
      _assert_same_values(sliced, {path: np.asarray(float_[path])[::14]}, [path])
  _assert_same_values(quant, float_, [("embed_VD",)])


def test_smollm_weight_bytes_shrink(smollm):
  float_model, quant_model, _ = smollm
  ratio = weight_bytes(quant_model) / weight_bytes(float_model)
  # int4-g32-asym: 4 bits + two f16 per 32 = 5 bits; int8-g32: 8.5 bits (embeddings), as the
  # file stores them: 0.179 of float32 measured, with the float norms.
  assert ratio < 0.185, ratio


def test_smollm_logits_match_the_float_load(smollm):
  float_model, quant_model, tok = smollm
  ids = tok.encode(tok.apply_chat_template(QUESTION))
  expected_BTV = _logits(float_model, [ids])
  assert np.max(np.abs(_logits(quant_model, [ids]) - expected_BTV)) <= LOGIT_TOL


def test_smollm_engine_greedy_tokens_match_the_float_load(smollm):
  float_model, quant_model, tok = smollm
  ids = tok.encode(tok.apply_chat_template(QUESTION))
  params = SamplingParams(max_tokens=6)
  got = [Engine(m, tok, max_seq_len=64, max_batch=1).generate([ids], params)[0]
         for m in (quant_model, float_model)]
  assert got[0].token_ids == got[1].token_ids
  assert "Paris" in got[0].text, got[0].text


# ---- a small synthetic GGUF: every supported type, untied output, a mixed stack ----

D, F, V, HEADS, KV_HEADS = 64, 96, 288, 4, 2
TYPES = {"attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0, "attn_output": QT.F16,
         "ffn_gate": QT.Q4_0, "ffn_up": QT.Q4_1, "ffn_down": (QT.Q4_0, QT.Q8_0)}  # per layer
SHAPES = {"attn_q": (D, D), "attn_k": (D // 2, D), "attn_v": (D // 2, D), "attn_output": (D, D),
          "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}  # [rows=out, cols=in]


def _write_gguf(path, types=TYPES, embed=QT.Q4_0, output=QT.Q8_0):
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama")
  for key, value in [("block_count", 2), ("context_length", 64), ("embedding_length", D),
                     ("feed_forward_length", F), ("head_count", HEADS),
                     ("head_count_kv", KV_HEADS)]:
    getattr(w, f"add_{key}")(value)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  w.add_token_list(alphabet + [f"<f{i}>" for i in range(V - len(alphabet))])

  def add(name, shape, qtype):
    x = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    if qtype in (QT.F32, QT.F16):
      w.add_tensor(name, x.astype(np.float16 if qtype == QT.F16 else np.float32))
    else:
      w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

  add("token_embd.weight", (V, D), embed)
  add("output.weight", (V, D), output)
  add("output_norm.weight", (D,), QT.F32)
  for i in range(2):
    for name, shape in SHAPES.items():
      t = types[name]
      add(f"blk.{i}.{name}.weight", shape, t[i] if isinstance(t, tuple) else t)
    add(f"blk.{i}.attn_norm.weight", (D,), QT.F32)
    add(f"blk.{i}.ffn_norm.weight", (D,), QT.F32)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_synthetic_gguf_every_format_matches_the_float_load(tmp_path):
  path = tmp_path / "tiny.gguf"
  _write_gguf(path)
  float_model, _ = models.load_pretrained(str(path))
  with pytest.warns(UserWarning, match="mix types"):
    quant_model, _ = models.load_pretrained(str(path), quantized=True)
  quant, float_ = _params(quant_model), _params(float_model)
  formats = {path[-1]: v.fmt.name for path, v in quant.items() if isinstance(v, QArray)}
  assert formats == {"wq_DNH": "int4-g32", "wk_DKH": "int4-g32-asym", "wv_DKH": "int8-g32",
                     "gate_DF": "int4-g32", "up_DF": "int4-g32-asym", "embed_VD": "int4-g32",
                     "unembed_DV": "int8-g32"}  # wo_NHD is F16; down_FD mixes Q4_0 and Q8_0
  _assert_same_values(quant, float_, [p for p, v in quant.items() if isinstance(v, QArray)])
  tokens_BT = np.random.default_rng(1).integers(0, V, size=(2, 12))
  np.testing.assert_allclose(_logits(quant_model, tokens_BT), _logits(float_model, tokens_BT),
                             rtol=0, atol=1e-5)


def test_quantized_load_refuses_unsupported_types(tmp_path):
  path = tmp_path / "q5.gguf"
  _write_gguf(path, types={**TYPES, "ffn_down": QT.Q5_0})
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has type Q5_0"):
    models.load_pretrained(str(path), quantized=True)


def test_quantized_needs_a_gguf_and_no_mesh(tmp_path):
  with pytest.raises(ValueError, match="quantized=True keeps a GGUF"):
    models.load_pretrained(str(tmp_path), quantized=True)
  path = tmp_path / "tiny.gguf"
  path.write_bytes(b"GGUF")  # refused before it is read
  with pytest.raises(ValueError, match="cannot place weights on a mesh"):
    models.load_pretrained(str(path), quantized=True, mesh=object())


def test_cli_runs_the_gguf_as_shipped_with_an_int8_kv_cache():
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", deps.smollm(),
                        "--prompt", "What is the capital of France?", "--chat",
                        "--gguf_quantized", "--kv_dtype", "int8", "--max_new_tokens", "12"],
                       capture_output=True, text=True, timeout=300, cwd=repo,
                       env=dict(os.environ, PYTHONPATH=repo))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "Paris" in out.stdout
