"""train/seq2seq_data.py: one set of real examples, packed right for each architecture."""

import json

import ml_collections
import numpy as np
import pytest

from experiments import arch_compare
from models import ConfigError
from train import global_data
from train import seq2seq_data
from train.setup import validate
from train.tokenizer_training import train_bpe_tokenizer

ARCHS = seq2seq_data.ARCHS


@pytest.fixture(scope="module")
def setup():
  config = arch_compare.get_config("decoder")
  config.data.seq2seq.max_words = 4
  tok = train_bpe_tokenizer(seq2seq_data.tokenizer_texts(config.data), 512)
  return config, tok


def _segments(batch, prefix=""):
  """{(row, segment id): {field: values}} for the `prefix` side of a packed batch."""
  seg_BT = batch[prefix + "segment_ids"]
  fields = [k for k in batch if k.startswith("enc_") == (prefix == "enc_")]
  out = {}
  for b, s in zip(*np.nonzero(seg_BT)):
    cell = out.setdefault((b, seg_BT[b, s]), {k: [] for k in fields})
    for k in fields:
      cell[k].append(int(batch[k][b, s]))
  return out


def _check_padding(batch, prefix=""):
  pad_BT = batch[prefix + "segment_ids"] == 0
  for k, v in batch.items():
    if k.startswith("enc_") == (prefix == "enc_"):
      assert not v[pad_BT].any(), k


def _examples_in(batches, arch, sep, eos):
  """Every packed example as (source ids, target ids), checking its layout on the way."""
  found = []
  for batch in batches:
    _check_padding(batch)
    dec = _segments(batch)
    if arch == "encoder_decoder":
      _check_padding(batch, "enc_")
      enc = _segments(batch, "enc_")
      assert enc.keys() == dec.keys()  # both sides of an example share its segment id
    for key, f in dec.items():
      n = len(f["inputs"])
      assert f["positions"] == list(range(n))
      if arch == "encoder_decoder":
        src = enc[key]["enc_inputs"]
        assert enc[key]["enc_positions"] == list(range(len(src)))
        assert f["inputs"][0] == sep and f["loss_mask"] == [1] * n
        tgt = f["inputs"][1:]
        assert f["targets"] == tgt + [eos]
      else:
        s = f["inputs"].index(sep)
        src, tgt = f["inputs"][:s], f["inputs"][s + 1:]
        assert f["targets"] == f["inputs"][1:] + [eos]
        # The loss covers exactly target + eos: no source token is ever a counted target.
        assert f["loss_mask"] == [0] * s + [1] * (n - s)
        assert [t for t, m in zip(f["targets"], f["loss_mask"]) if m] == tgt + [eos]
        if arch == "prefix_lm":
          assert f["prefix"] == [1] * (s + 1) + [0] * (n - s - 1)
        else:
          assert "prefix" not in f
      found.append((tuple(src), tuple(tgt)))
  return found


def test_every_arch_gets_the_same_examples_laid_out_right(setup):
  config, tok = setup
  sep, eos = seq2seq_data.special_ids(tok)
  pairs = seq2seq_data.load_pairs(config.data, "validation")
  expected = sorted((tuple(tok.encode(s, add_bos=False)), tuple(tok.encode(t, add_bos=False)))
                    for s, t in pairs)
  for arch in ARCHS:
    seq_len = 64 if arch == "encoder_decoder" else 128
    ds = seq2seq_data.make_dataset(config.data, tok, arch=arch, seq_len=seq_len, batch_size=8,
                                   split="validation", seed=0)
    batches = list(ds)
    assert all(b["inputs"].shape == (8, seq_len) for b in batches)
    if arch == "encoder_decoder":
      assert all(b["enc_inputs"].shape == (8, 64) for b in batches)
    found = _examples_in(batches, arch, sep, eos)
    assert sorted(found) == expected, arch  # each validation example exactly once
    assert max(b["segment_ids"].max() for b in batches) > 2  # several examples share a row
  # The task itself: the target is the source's words reversed.
  for src, tgt in expected[:50]:
    assert tok.decode(tgt).split() == tok.decode(src).split()[::-1]


def test_train_split_repeats_shuffled_and_global_batches_keep_every_field(setup):
  config, tok = setup
  ds = global_data.make_global_dataset(config.data, tok, seq_len=64, global_batch_size=4,
                                    split="train", seed=0, num_shards=2, arch="encoder_decoder")
  it = iter(ds)
  first = [next(it) for _ in range(3)]
  assert set(first[0]) == {"inputs", "targets", "segment_ids", "positions", "loss_mask",
                           "enc_inputs", "enc_segment_ids", "enc_positions"}
  assert all(b["inputs"].shape == (4, 64) and b["enc_inputs"].shape == (4, 64) for b in first)
  again = next(iter(global_data.make_global_dataset(
      config.data, tok, seq_len=64, global_batch_size=4, split="train", seed=0, num_shards=2,
      arch="encoder_decoder")))
  assert all(np.array_equal(first[0][k], again[k]) for k in again)
  other_seed = next(iter(global_data.make_global_dataset(
      config.data, tok, seq_len=64, global_batch_size=4, split="train", seed=1, num_shards=2,
      arch="encoder_decoder")))
  assert not np.array_equal(first[0]["inputs"], other_seed["inputs"])


def test_split_is_deterministic_disjoint_and_complete(setup):
  config, _ = setup
  train, val = (seq2seq_data.load_pairs(config.data, s) for s in ("train", "validation"))
  assert seq2seq_data.load_pairs(config.data, "validation") == val
  train_src, val_src = {s for s, _ in train}, {s for s, _ in val}
  assert not train_src & val_src
  assert len(train_src) == len(train) and len(val_src) == len(val)  # sources are distinct
  lines = seq2seq_data._lines(config.data)
  assert train_src | val_src == set(lines)
  assert abs(len(val) / len(lines) - config.data.val_fraction) < 0.03
  assert all(3 <= len(s.split()) <= 4 and not s.endswith(":") for s in lines)


def test_sources_that_do_not_fit_are_refused_by_name(setup):
  config, tok = setup
  pairs = seq2seq_data.load_pairs(config.data, "train")
  longest = max(len(tok.encode(s, add_bos=False)) for s, _ in pairs)
  config.data.seq2seq.source_len = longest - 1
  with pytest.raises(ValueError, match=r"longer than the encoder length data\.seq2seq\.source_len"):
    seq2seq_data.load_examples(config.data, tok, "train", arch="encoder_decoder", seq_len=64)
  with pytest.raises(ValueError, match=r"more than seq_len=8"):
    seq2seq_data.load_examples(config.data, tok, "train", arch="decoder", seq_len=8)
  with pytest.raises(ValueError, match="cannot train on data.task='seq2seq'"):
    seq2seq_data.load_examples(config.data, tok, "train", arch="encoder", seq_len=64)
  config.data.seq2seq.source_len = 64


def test_seq2seq_on_an_lm_only_dataset_fails_clearly(tmp_path, setup):
  config, tok = setup
  cfg = ml_collections.ConfigDict(config.data.to_dict())
  cfg.seq2seq.transform = ""  # pairs must come from the data, and a .txt file has none
  with pytest.raises(ValueError, match="plain text, an LM-only dataset"):
    seq2seq_data.load_pairs(cfg, "train")
  lines = seq2seq_data._lines(config.data)[:40]
  good = tmp_path / "pairs.jsonl"
  good.write_text("".join(json.dumps({"source": s, "target": s.upper()}) + "\n" for s in lines))
  cfg.path = str(good)
  cfg.val_fraction = 0.0
  assert seq2seq_data.load_pairs(cfg, "train") == [(s, s.upper()) for s in lines]
  bad = tmp_path / "lm.jsonl"
  bad.write_text(json.dumps({"text": lines[0]}) + "\n")
  cfg.path = str(bad)
  with pytest.raises(ValueError, match=r"lm\.jsonl:1: a seq2seq record needs .*'source'"):
    seq2seq_data.load_pairs(cfg, "train")
  cfg.seq2seq.transform = "shuffle_words"
  with pytest.raises(ValueError, match="transform='shuffle_words'"):
    seq2seq_data.load_pairs(cfg, "train")


def test_the_config_must_ask_for_pairs_to_train_an_encoder_decoder(setup):
  config = arch_compare.get_config("encoder_decoder")
  config.data.task = "lm"
  with pytest.raises(ConfigError, match="encoder_decoder.*data.task='seq2seq'"):
    validate(config)
  config.data.task = "translate"
  with pytest.raises(ConfigError, match="data.task='translate'"):
    validate(config)
  _, tok = setup
  lm_data = arch_compare.get_config("decoder").data
  lm_data.task = "lm"
  with pytest.raises(ValueError, match="data.task='seq2seq'"):
    global_data.make_global_dataset(lm_data, tok, seq_len=64, global_batch_size=4, split="train",
                                 seed=0, arch="encoder_decoder")
