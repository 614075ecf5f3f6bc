"""GGUF files made by llama.cpp's own converter (tests/data/gguf_families/make.py) from random
tiny Llama 3.1, Qwen2 and Gemma 2 directories: meshlm's load of each file gives transformers'
float32 logits of the directory it came from (≤ 1e-4), and greedy tokens, and its
SentencePiece vocabulary encodes as SentencePiece itself does."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")
sentencepiece = deps.require("sentencepiece")

import models  # noqa: E402
from conftest import REPO  # noqa: E402
from infer import Engine, SamplingParams  # noqa: E402
from models.gguf_io import read_gguf  # noqa: E402

DATA = os.path.join(REPO, "tests", "data", "gguf_families")
NAMES = ["llama3", "qwen2", "gemma2"]
TOL = 1e-4


def _paths(name):
  directory = os.path.join(DATA, name)
  return directory, os.path.join(directory, "model-f32.gguf")


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
  directory, gguf = _paths(request.param)
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  ours, tokenizer = models.load_pretrained(gguf)
  return request.param, hf, ours, tokenizer


def test_logits_equal_the_directorys(pair):
  """48 tokens: 3x Llama 3.1's 16 original positions (its rope_freqs), past Gemma 2's window."""
  _, hf, ours, _ = pair
  tokens_BT = np.random.default_rng(0).integers(3, 512, size=(2, 48))
  with torch.no_grad():
    want = hf(torch.from_numpy(tokens_BT)).logits.numpy()
  with jax.default_matmul_precision("highest"):
    got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, jnp.asarray(tokens_BT, jnp.int32)))
  assert np.max(np.abs(got - want)) <= TOL


def test_greedy_tokens_equal_transformers_generate(pair):
  _, hf, ours, tokenizer = pair
  prompt = np.random.default_rng(1).integers(3, 512, size=(20,)).tolist()
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
  with jax.default_matmul_precision("highest"):
    (got,) = Engine(ours, tokenizer, 40, 1).generate(
        [prompt], SamplingParams(max_tokens=16, ignore_eos=True))
  assert got.token_ids == want


def test_each_file_maps_to_its_family():
  cfgs = {n: read_gguf(_paths(n)[1])[0] for n in NAMES}
  assert {n: c.hf_family for n, c in cfgs.items()} == {n: n.rstrip("3") for n in NAMES}
  assert cfgs["llama3"].rope_scaling == "factors" and cfgs["llama3"].rope_theta == 5e5
  assert max(cfgs["llama3"].rope_freq_factors) == 8.0  # the llama3 factor, on low frequencies
  assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].tie_embeddings
  g = cfgs["gemma2"]
  assert (g.attn_softcap, g.final_softcap, g.sliding_window, g.layer_pattern) == (2.0, 3.0, 8,
                                                                                   "LG")


def test_a_rope_freqs_model_does_not_export_to_hugging_face(tmp_path):
  """No config.json says "divide each frequency by these": refused, not approximated."""
  ours, tokenizer = models.load_pretrained(_paths("llama3")[1])
  with pytest.raises(ValueError, match="no Hugging Face config.json form"):
    models.export_hf(ours, tokenizer, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def _lines():
  with open(os.path.join(REPO, "data", "tinyshakespeare", "input.txt")) as f:
    text = f.read()
  lines = [line for line in text.splitlines() if line.strip()][5000:5300]
  # byte fallback (characters the 512 pieces never saw), runs of spaces, tabs, digits
  return lines + ["Ünïcödé ☃ 🦙 нещо на Български", "a  b   c\tmixed  spacing", "1234567890",
                  " leading space", "trailing space ", ""]


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_the_sentencepiece_vocabulary_encodes_as_sentencepiece(name):
  """The converter wrote the pieces and scores of tests/data/gguf_families/spm.model (trained
  without normalisation, as llama.cpp applies none); meshlm's tokenizer of the file encodes
  and decodes 300 lines of Shakespeare and some harder strings as SentencePiece does."""
  sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(DATA, "spm.model"))
  tokenizer = models.load_pretrained_tokenizer(_paths(name)[1])
  for line in _lines():
    want = sp.encode(line)
    assert tokenizer.encode(line, add_bos=False) == want, line
    assert tokenizer.decode(want) == sp.decode(want), line
  assert tokenizer.encode("Hello", add_bos=True)[0] == sp.bos_id()
  # A control token written in the text is that token (as transformers' tokenizers and
  # llama.cpp's parse_special read chat templates), and the text after it gets its own space
  # prefix, as llama.cpp gives it.
  assert tokenizer.encode("<s> is text", add_bos=False) == [sp.bos_id()] + sp.encode(" is text")
