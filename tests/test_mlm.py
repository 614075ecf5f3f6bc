"""Masked-LM data for encoders (train/mlm_data.py) and `meshlm train` of a BERT-style encoder."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tokenizers

from models import ConfigError, Tokenizer
from train import mlm_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _word_tokenizer(words):
  vocab = {w: i for i, w in enumerate(words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=words[0]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return Tokenizer(tok)


def test_mask_id_is_the_tokenizers_own_or_a_reserved_one():
  assert mlm_data.mask_id(_word_tokenizer(["<unk>", "a", "[MASK]", "b"]), 4) == 2
  assert mlm_data.mask_id(_word_tokenizer(["<unk>", "a", "b"]), 8) == 3
  with pytest.raises(ConfigError, match="needs a mask token.*model.vocab_size > 3"):
    mlm_data.mask_id(_word_tokenizer(["<unk>", "a", "b"]), 3)


def test_masking_follows_bert_and_keeps_padding_out():
  rng = np.random.default_rng(0)
  tokens_BT = rng.integers(0, 100, (64, 256)).astype(np.int32)
  segment_ids_BT = np.ones_like(tokens_BT)
  segment_ids_BT[:, 200:] = 0  # padding is never chosen
  batch = {"inputs": tokens_BT, "targets": np.roll(tokens_BT, -1, 1),
           "segment_ids": segment_ids_BT, "positions": np.zeros_like(tokens_BT)}
  out = mlm_data.MaskTokens(mask=100, random_vocab=100, mask_prob=0.15).random_map(
      batch, np.random.default_rng(1))
  chosen = out["loss_mask"].astype(bool)
  np.testing.assert_array_equal(out["targets"], tokens_BT)  # predict the original token
  assert not chosen[:, 200:].any()
  assert 0.14 < chosen[:, :200].mean() < 0.16
  masked = out["inputs"][chosen] == 100
  kept = out["inputs"][chosen] == tokens_BT[chosen]
  assert 0.77 < masked.mean() < 0.83 and 0.09 < kept.mean() < 0.13  # 10% + random hits
  np.testing.assert_array_equal(out["inputs"][~chosen], tokens_BT[~chosen])
  with pytest.raises(ConfigError, match="mask_prob=1.5"):
    mlm_data.MaskTokens(1, 1, 1.5)


def _meshlm(*args):
  return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                        text=True, cwd=REPO, timeout=600)


TINY = ["--config.steps=6", "--config.batch_size=4", "--config.seq_len=32",
        "--config.log_every=2", "--config.eval_every=6", "--config.eval_batches=1",
        "--config.checkpoint_every=6", "--config.model.vocab_size=328",
        "--config.tokenizer.train_vocab_size=320", "--config.model.d_model=32",
        "--config.model.num_heads=2", "--config.model.num_kv_heads=2",
        "--config.model.num_layers=1", "--config.model.mlp_dim=64",
        "--config.peak_flops_per_device=1e11"]


def test_train_an_encoder_then_embed_end_to_end(tmp_path):
  config = os.path.join(REPO, "experiments", "mlm_shakespeare.py")
  run = _meshlm("train", "--config", config, "--workdir", str(tmp_path / "run"), *TINY)
  assert run.returncode == 0, run.stderr[-3000:]
  metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  losses = [m["loss"] for m in metrics if "loss" in m]
  assert losses and all(np.isfinite(losses))
  assert any("val_loss" in m for m in metrics)
  texts = tmp_path / "texts.txt"
  texts.write_text("To be, or not to be\nThe quality of mercy is not strain'd\n")
  out = tmp_path / "emb.npy"
  run = _meshlm("embed", "--model", str(tmp_path / "run"), "--input", str(texts),
                "--output", str(out))
  assert run.returncode == 0, run.stderr[-3000:]
  emb = np.load(out)
  assert emb.shape == (2, 32)
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--config.data.task=lm"], "model.arch='encoder' trains with data.task='mlm', not 'lm'"),
    (["--config.model.arch=decoder"], "data.task='mlm' .* trains encoders"),
    (["--config.data.task=cloze"], "data.task='cloze'; choose one of"),
    (["--config.model.vocab_size=320"], "needs a mask token.*model.vocab_size > 3"),
    (["--config.seq_len=256"], "rows of 256 tokens .* exceed model.max_seq_len=128"),
    (["--config.data.mlm.mask_prob=0"], "mask_prob=0"),
])
def test_mismatched_task_and_arch_fail_before_anything_is_written(tmp_path, flags, message):
  config = os.path.join(REPO, "experiments", "mlm_shakespeare.py")
  run = _meshlm("train", "--config", config, "--workdir", str(tmp_path / "run"), *TINY, *flags)
  assert run.returncode != 0
  assert re.search(message, run.stderr), run.stderr[-2000:]
  assert not (tmp_path / "run").exists()
