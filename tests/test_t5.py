"""T5: random transformers T5ForConditionalGeneration checkpoints load with the same logits,
and Seq2SeqEngine's KV-cached greedy decoding matches HF generate and the uncached forward."""

import functools
import json
import os
import shutil

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tokenizers  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from infer import kv_cache  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.seq2seq import EncoderView, Seq2SeqEngine  # noqa: E402
from models import hf_t5  # noqa: E402
from models.config import ConfigError  # noqa: E402

TOL = 1e-4  # float32 on both sides; differences are summation order only
VOCAB = 97
STYLES = {
    # Original T5: ReLU MLP, tied embeddings (output scaled by d_model**-0.5), heads*d_kv != D.
    "t5": dict(feed_forward_proj="relu", d_model=32, d_kv=12, num_heads=4, d_ff=48,
               num_layers=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=20),
    # T5 v1.1: gated tanh-GELU, its own lm_head (no output scale), a deeper decoder.
    "v1_1": dict(feed_forward_proj="gated-gelu", d_model=32, d_kv=8, num_heads=4, d_ff=40,
                 num_layers=2, num_decoder_layers=3, relative_attention_num_buckets=16,
                 relative_attention_max_distance=24),
}
# Sources long enough that relative distances reach the log-spaced and the last buckets.
SRC_LENS, DEC_LEN = (22, 13), 12


def make_t5(directory, style, seed=0):
  """A random T5 saved as safetensors; returns the eval-mode HF model."""
  config = transformers.T5Config(vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                 pad_token_id=0, eos_token_id=1, initializer_factor=2.0,
                                 tie_word_embeddings=style == "t5", **STYLES[style])
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "layer_norm" in name:  # non-trivial scales, so a swapped norm shows up
        p.normal_(1.0, 0.3)
      elif "relative_attention_bias" in name:  # large, so a wrong bucket shows up
        p.normal_(0.0, 2.0)
    if style == "v1_1":
      # Logits of order 5, as with the tied head: at order 20, float32 rounding alone moves
      # them by ~7e-5 (HF float32 vs float64), too close to TOL to tell a bug from noise.
      model.lm_head.weight = torch.nn.Parameter(0.25 * torch.randn(VOCAB, config.d_model))
  assert (model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()) == (style == "t5")
  model.save_pretrained(directory, safe_serialization=True)
  return model


def batch(seed=1):
  """Sources (right-padded with pad=0) and their mask, and teacher-forced decoder inputs."""
  rng = np.random.default_rng(seed)
  src = np.zeros((2, max(SRC_LENS)), np.int64)
  mask = np.zeros_like(src)
  for i, n in enumerate(SRC_LENS):
    src[i, :n] = rng.integers(2, VOCAB, n)
    mask[i, :n] = 1
  dec = rng.integers(2, VOCAB, (2, DEC_LEN))
  dec[:, 0] = 0  # the decoder start token
  return src, mask, dec


def _checkpoint(style, tmp_path_factory):
  """(style, checkpoint dir, HF model, HF logits, our model)."""
  directory = str(tmp_path_factory.mktemp(style))
  hf = make_t5(directory, style)
  src, mask, dec = batch()
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(mask),
              decoder_input_ids=torch.tensor(dec)).logits.numpy()
  with pytest.warns(UserWarning, match="no tokenizer.json"):
    ours, tokenizer = hf_t5.load(directory)
  assert tokenizer is None
  return style, directory, hf, want, ours


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return {style: _checkpoint(style, tmp_path_factory) for style in STYLES}


@pytest.fixture(params=list(STYLES))
def t5(request, checkpoints):
  return checkpoints[request.param]


@pytest.fixture
def v1_1(checkpoints):
  """For tests that need one checkpoint, not each style."""
  return checkpoints["v1_1"]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, state, dec_BT, src_BS, mask_BS):
  return nnx.merge(graphdef, state)(dec_BT, enc_inputs_BS=src_BS, enc_segment_ids_BS=mask_BS)


def our_logits(model):
  """Teacher-forced logits for batch() (jitted: reloaded models reuse the compilation)."""
  src, mask, dec = batch()
  return np.asarray(_forward(*nnx.split(model), *(jnp.asarray(a, jnp.int32)
                                                  for a in (dec, src, mask))))


def test_logits_match_transformers(t5):
  style, _, _, want, model = t5
  cfg = model.cfg
  assert cfg.tie_embeddings == (style == "t5")
  assert cfg.mlp_activation == {"t5": "relu", "v1_1": "geglu"}[style]
  assert cfg.decoder_layers == {"t5": 2, "v1_1": 3}[style]
  diff = np.abs(our_logits(model) - want).max()
  print(f"{style}: max abs logit diff {diff:.2e}")
  assert diff < TOL


@pytest.mark.parametrize("proj,ours", [("gelu", "gelu"), ("gated-silu", "swiglu")])
def test_other_feed_forwards_match_transformers(proj, ours, tmp_path):
  """The remaining feed_forward_proj values we accept: erf-GELU, and gated SiLU (SwiGLU)."""
  config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, num_heads=2, d_ff=24,
                                 num_layers=1, dropout_rate=0.0, feed_forward_proj=proj)
  # initializer_factor stays 1: at 2 a gated MLP's activations grow so large that float32
  # rounding alone moves the logits by ~1e-4 (HF float32 vs float64), as much as TOL.
  torch.manual_seed(0)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  hf.save_pretrained(tmp_path, safe_serialization=True)
  src, mask, dec = batch()
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(mask),
              decoder_input_ids=torch.tensor(dec)).logits.numpy()
  with pytest.warns(UserWarning):
    model, _ = hf_t5.load(str(tmp_path))
  assert model.cfg.mlp_activation == ours
  assert np.abs(our_logits(model) - want).max() < TOL


def test_transformers4_config_loads_the_same(t5, tmp_path):
  """Hub configs from transformers 4 say tie_word_embeddings=false (v1.1) and have no
  scale_decoder_outputs; they must mean the same model."""
  style, directory, _, want, _ = t5
  shutil.copy(os.path.join(directory, "model.safetensors"), tmp_path)
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)
  config.pop("scale_decoder_outputs")
  config["tie_word_embeddings"] = style == "t5"
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.warns(UserWarning):
    model, _ = hf_t5.load(str(tmp_path))
  assert np.abs(our_logits(model) - want).max() < TOL


def hf_greedy(hf, n, eos_ids):
  """HF greedy token ids per row of batch()'s sources, start token stripped, cut after EOS."""
  src, mask, _ = batch()
  with torch.no_grad():
    out = hf.generate(input_ids=torch.tensor(src), attention_mask=torch.tensor(mask),
                      do_sample=False, num_beams=1, max_new_tokens=n, eos_token_id=eos_ids,
                      # transformers 5.24 sizes its KV cache by the encoder's depth, which
                      # breaks when num_decoder_layers > num_layers; uncached is as good a reference
                      use_cache=False).numpy()
  rows = []
  for ids in out[:, 1:].tolist():
    stop = [i for i, t in enumerate(ids) if t in eos_ids]
    rows.append(ids[:stop[0] + 1] if stop else ids)  # HF pads rows after their EOS
  return rows


def test_greedy_generation_matches_transformers(t5):
  _, _, hf, _, model = t5
  src, _, _ = batch()
  n = 10
  engine = Seq2SeqEngine(model, max_seq_len=32, max_batch=2)
  sources = [src[i, :k].tolist() for i, k in enumerate(SRC_LENS)]
  want = hf_greedy(hf, n, [1])
  results = engine.generate(sources, SamplingParams(max_tokens=n))
  assert [r.token_ids for r in results] == want
  assert want[0] != want[1]  # the two sources decode differently
  # A stop token the first row emits early: it stops there while the other row goes on.
  stop = want[0][1]
  want = hf_greedy(hf, n, [1, stop])
  assert len(want[0]) == 2
  results = engine.generate(sources, SamplingParams(max_tokens=n, stop_token_ids=(stop,)))
  assert [r.token_ids for r in results] == want
  assert [r.finish_reason for r in results] == [
      "stop" if w[-1] in (1, stop) else "length" for w in want]


def test_text_sources_with_a_tokenizer(v1_1, tmp_path):
  """A tokenizer.json beside the weights loads; text sources end with </s>, as T5's do."""
  _, directory, _, _, _ = v1_1
  shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
  vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
  tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
  tok.save(os.path.join(tmp_path, "tokenizer.json"))
  with open(os.path.join(tmp_path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, f)
  model, tokenizer = hf_t5.load(str(tmp_path))
  assert (tokenizer.eos_id, tokenizer.pad_id) == (1, 0)
  engine = Seq2SeqEngine(model, tokenizer, max_seq_len=16, max_batch=1)
  params = SamplingParams(max_tokens=6)
  by_text = engine.generate("w5 w6 w7", params)[0]
  by_ids = engine.generate([[5, 6, 7, 1]], params)[0]
  assert by_text.token_ids == by_ids.token_ids and by_text.prompt_tokens == 4
  ids = by_text.token_ids[:-1] if by_text.finish_reason == "stop" else by_text.token_ids
  assert by_text.text == " ".join(f"w{i}" for i in ids)
  streamed = list(engine.stream("w5 w6 w7", params))  # the Engine's streaming, inherited
  assert [t.token_id for t in streamed] == by_text.token_ids
  assert "".join(t.text for t in streamed) == by_text.text


def test_engine_refuses_bad_requests(v1_1):
  engine = Seq2SeqEngine(v1_1[-1], max_seq_len=8, max_batch=2)
  results = engine.generate([[], [5] * 9, "no tokenizer", [VOCAB]], SamplingParams(max_tokens=4))
  assert [r.error for r in results] == [
      "empty source: a request needs at least one source token",
      "source of 9 tokens exceeds max_source_len=8",
      "a text source needs a tokenizer; pass token ids or a tokenizer",
      f"source token id {VOCAB} is outside the vocabulary [0, {VOCAB})"]
  with pytest.raises(ValueError, match="max_tokens=9 exceeds the decoder's max_seq_len=8"):
    engine.generate([5, 6], SamplingParams(max_tokens=9))


@functools.partial(jax.jit, static_argnames=("graphdef", "all_logits"))
def _cached_forward(graphdef, state, enc_kv, enc_segment_ids_BS, tokens_BT, cache, all_logits):
  view = EncoderView(nnx.merge(graphdef, state), enc_kv, enc_segment_ids_BS)
  return kv_cache.forward(view, tokens_BT, jnp.ones(tokens_BT.shape, jnp.int32), cache,
                          all_logits=all_logits)


def test_cached_logits_match_uncached_forward(t5):
  """Teacher forcing through the KV cache, one token a step and as one chunk."""
  _, _, _, _, model = t5
  src, mask, dec = batch()
  want = our_logits(model)
  enc_segment_ids_BS = jnp.asarray(mask, jnp.int32)
  enc_kv = model.cross_kv(model.encode(jnp.asarray(src, jnp.int32), None, enc_segment_ids_BS))
  graphdef, state = nnx.split(model)
  forward = functools.partial(_cached_forward, graphdef, state, enc_kv, enc_segment_ids_BS)
  cache = kv_cache.init(model.cfg, 2, 16)
  steps = []
  for t in range(DEC_LEN):
    logits_BV, cache = forward(jnp.asarray(dec[:, t:t + 1], jnp.int32), cache, False)
    steps.append(np.asarray(logits_BV))
  assert np.abs(np.stack(steps, 1) - want).max() < TOL
  chunk, _ = forward(jnp.asarray(dec, jnp.int32), kv_cache.init(model.cfg, 2, 16), True)
  assert np.abs(np.asarray(chunk) - want).max() < TOL


def test_batch_mismatch_is_refused(v1_1):
  model = v1_1[-1]
  with pytest.raises(ValueError, match="decoder batch 1 != encoder batch 2"):
    model(jnp.zeros((1, 4), jnp.int32), enc_inputs_BS=jnp.zeros((2, 5), jnp.int32))


def test_load_onto_mesh(v1_1):
  from parallel import make_mesh
  _, directory, _, want, _ = v1_1
  with pytest.warns(UserWarning):
    model, _ = hf_t5.load(directory, mesh=make_mesh({}))
  assert isinstance(model.blocks.cross_attn.wq_DNH[...].sharding, jax.sharding.NamedSharding)
  assert np.abs(our_logits(model) - want).max() < TOL


def _with_config(directory, tmp_path, **changes):
  os.makedirs(tmp_path)
  shutil.copy(os.path.join(directory, "model.safetensors"), tmp_path)
  with open(os.path.join(directory, "config.json")) as f:
    config = {**json.load(f), **changes}
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(config, f)
  return str(tmp_path)


def test_output_head_variants_match_transformers(t5, tmp_path):
  """The scale flipped: a tied head without the scale (what transformers 5 builds from a v1.1
  config), and a separate head with it (folded into unembed_DV)."""
  style, directory, _, _, _ = t5
  path = _with_config(directory, tmp_path / "flipped", scale_decoder_outputs=style != "t5")
  hf = transformers.T5ForConditionalGeneration.from_pretrained(path).eval()
  src, mask, dec = batch()
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(mask),
              decoder_input_ids=torch.tensor(dec)).logits.numpy()
  with pytest.warns(UserWarning):
    model, _ = hf_t5.load(path)
  assert not model.cfg.tie_embeddings
  assert np.abs(our_logits(model) - want).max() < TOL


def test_bad_configs_are_refused(t5, tmp_path):
  _, directory, _, _, _ = t5
  with pytest.raises(ConfigError, match=f"vocab_size={VOCAB}.*decoder_vocab_size={VOCAB + 3}"):
    hf_t5.load(_with_config(directory, tmp_path / "vocab", decoder_vocab_size=VOCAB + 3))
  with pytest.raises(ValueError, match="feed_forward_proj='gated-relu' is not supported"):
    hf_t5.load(_with_config(directory, tmp_path / "ff", feed_forward_proj="gated-relu"))
  with pytest.raises(ValueError, match="unsupported architecture.*T5EncoderModel"):
    hf_t5.load(_with_config(directory, tmp_path / "arch", architectures=["T5EncoderModel"]))
  with pytest.raises(ValueError, match="has shape .* but the config implies"):
    hf_t5.load(_with_config(directory, tmp_path / "shape", d_ff=50))


# LEAD: checks the routing of model_type "t5" in models/pretrained.py (another helper's change).
def test_load_pretrained_routes_t5(t5):
  _, directory, _, want, _ = t5
  with pytest.warns(UserWarning):
    model, _ = models.load_pretrained(directory)
  assert isinstance(model, models.EncoderDecoder)
  assert np.abs(our_logits(model) - want).max() < TOL
