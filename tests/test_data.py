"""Tests for the grain data pipeline, document sources and BPE training."""

import collections
import gzip
import itertools
import json
import math
import os

import grain
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from train import data
from train.defaults import base_config
from train.setup import resolve_tokenizer
from train.tokenizer_training import train_bpe_tokenizer, unigram_entropy

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare",
                           "input.txt")
SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def text():
  with open(SHAKESPEARE, encoding="utf-8") as f:
    return f.read(30_000)  # ~200 documents: enough for every property, fast


@pytest.fixture(scope="module")
def tokenizer(text):
  return train_bpe_tokenizer([text], vocab_size=300)


@pytest.fixture(scope="module")
def cfg(text, tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "slice.txt"
  path.write_text(text, encoding="utf-8")
  return ml_collections.ConfigDict(
      dict(path=str(path), text_key="text", doc_separator="\n\n", val_fraction=0.2))


def make(cfg, tokenizer, split="train", seed=0, **kw):
  kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, process_index=0, process_count=1) | kw
  return data.make_dataset(cfg, tokenizer, split=split, seed=seed, **kw)


def take(it, n):
  return list(itertools.islice(it, n))


def assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def segments(batches):
  """Every packed segment as (inputs, targets) tuples, plus the padding count."""
  out, padding = [], 0
  for b in batches:
    for row in range(b["inputs"].shape[0]):
      seg = b["segment_ids"][row]
      padding += int((seg == 0).sum())
      for s in np.unique(seg[seg > 0]):
        m = seg == s
        out.append((tuple(b["inputs"][row][m].tolist()), tuple(b["targets"][row][m].tolist())))
  return out, padding


def expected_chunks(docs, tokenizer, seq_len):
  chunks = []
  for doc in docs:
    ids = [tokenizer.bos_id] + tokenizer.encode(doc, add_bos=False) + [tokenizer.eos_id]
    inputs, targets = ids[:-1], ids[1:]
    for i in range(0, len(inputs), seq_len):
      chunks.append((tuple(inputs[i:i + seq_len]), tuple(targets[i:i + seq_len])))
  return chunks


def test_batch_fields_and_packing_invariants(cfg, tokenizer):
  batches = take(iter(make(cfg, tokenizer)), 10)
  bos, eos = tokenizer.bos_id, tokenizer.eos_id
  for b in batches:
    assert set(b) == set(data.FIELDS)
    for v in b.values():
      assert v.shape == (BATCH, SEQ_LEN) and v.dtype == np.int32
    for row in range(BATCH):
      inp, tgt, seg, pos = (b[k][row] for k in ("inputs", "targets", "segment_ids", "positions"))
      pad = seg == 0
      assert not (inp[pad].any() or tgt[pad].any() or pos[pad].any())
      n = int((~pad).sum())
      assert not pad[:n].any(), "first-fit packs from the left; padding only at the end"
      ids = seg[:n]
      starts = np.flatnonzero(np.diff(ids, prepend=0))
      assert list(ids[starts]) == list(range(1, len(starts) + 1))
      for s, e in zip(starts, list(starts[1:]) + [n]):
        np.testing.assert_array_equal(pos[s:e], np.arange(e - s))
        np.testing.assert_array_equal(tgt[s:e - 1], inp[s + 1:e])
        # A segment shorter than seq_len is a whole document or its last chunk.
        assert e - s == SEQ_LEN or tgt[e - 1] == eos
  starts_with_bos = sum(int((b["inputs"][b["positions"] == 0] == bos).sum()) for b in batches)
  assert starts_with_bos > 0


def test_validation_is_one_padded_pass_with_long_documents_chunked(cfg, tokenizer):
  docs = data.load_split(cfg, "validation")
  want = expected_chunks(docs, tokenizer, SEQ_LEN)
  assert len(want) > len(docs), "the slice must contain documents longer than seq_len"
  batches = list(make(cfg, tokenizer, split="validation"))
  got, padding = segments(batches)
  assert sorted(got) == sorted(want)  # every chunk exactly once, nothing else
  assert all(b["inputs"].shape == (BATCH, SEQ_LEN) for b in batches)
  assert padding == len(batches) * BATCH * SEQ_LEN - sum(len(i) for i, _ in want)
  # Finite: a second pass over the same iterator is empty.
  it = iter(make(cfg, tokenizer, split="validation"))
  assert len(list(it)) == len(batches) and next(it, None) is None


def test_split_is_deterministic_disjoint_and_about_val_fraction(cfg):
  all_docs = data.read_documents(cfg.path)
  train, val = data.load_split(cfg, "train"), data.load_split(cfg, "validation")
  assert len(train) + len(val) == len(all_docs)
  assert not set(train) & set(val)
  assert abs(len(val) / len(all_docs) - cfg.val_fraction) < 0.1
  assert val == data.load_split(cfg, "validation")
  with pytest.raises(ValueError, match="validation split .* is empty"):
    data.load_split(ml_collections.ConfigDict(cfg.to_dict() | {"val_fraction": 0.0}),
                    "validation")


def test_same_seed_same_batches_different_seed_differs(cfg, tokenizer):
  a = take(iter(make(cfg, tokenizer, seed=1)), 6)
  assert_same_batches(a, take(iter(make(cfg, tokenizer, seed=1)), 6))
  b = take(iter(make(cfg, tokenizer, seed=2)), 6)
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


def test_train_repeats_with_a_new_order_each_epoch():
  ds = data.document_dataset(list(range(50)), split="train", seed=0, process_index=0,
                             process_count=1)
  first, second = list(ds[:50]), list(ds[50:100])
  assert sorted(first) == sorted(second) == list(range(50))
  assert first != second and first != list(range(50))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_process_shards_are_disjoint_and_cover(split):
  n = 41  # odd, so the shards differ in size
  shards = [list(data.document_dataset(list(range(n)), split=split, seed=3, process_index=p,
                                       process_count=2)[:(n + 1 - p) // 2]) for p in (0, 1)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == list(range(n))


def test_two_process_validation_batches_cover_the_single_process_ones(cfg, tokenizer):
  whole, _ = segments(make(cfg, tokenizer, split="validation"))
  parts = [segments(make(cfg, tokenizer, split="validation", process_index=p,
                         process_count=2))[0] for p in (0, 1)]
  assert parts[0] and parts[1]
  assert sorted(parts[0] + parts[1]) == sorted(whole)


def test_state_restore_resumes_identically(cfg, tokenizer):
  ds = make(cfg, tokenizer)
  it = iter(ds)
  take(it, 5)  # mid packing round: 128 bins > 4 rows per batch
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON (grain.checkpoint)
  want = take(it, 8)
  restored = iter(ds)
  restored.set_state(state)
  assert_same_batches(take(restored, 8), want)
  # A fresh pipeline (as after a restart) restores too.
  fresh = iter(make(cfg, tokenizer))
  fresh.set_state(state)
  assert_same_batches(take(fresh, 8), want)


def test_orbax_checkpoint_manager_round_trip(cfg, tokenizer, tmp_path):
  it = iter(make(cfg, tokenizer))
  take(it, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    want = take(it, 4)
    restored = iter(make(cfg, tokenizer))
    mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  assert_same_batches(take(restored, 4), want)


def test_text_jsonl_gz_glob_and_list_sources(tmp_path):
  (tmp_path / "a.txt").write_text("one\n\n\n\ntwo\nlines\n\n  \n\nthree")
  (tmp_path / "b.jsonl").write_text('{"text": "four"}\n\n{"text": "", "x": 1}\n')
  with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
    f.write(json.dumps({"body": "five"}) + "\n")
  assert data.read_documents(str(tmp_path / "a.txt")) == ["one", "two\nlines", "three"]
  assert data.read_documents(str(tmp_path / "*.jsonl")) == ["four"]
  assert data.read_documents([str(tmp_path / "c.jsonl.gz")], text_key="body") == ["five"]
  assert data.resolve_paths(str(tmp_path / "*")) == [
      str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")]


def test_missing_files_and_bad_jsonl_give_clear_errors(tmp_path):
  missing = str(tmp_path / "nope.txt")
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    data.read_documents(missing)
  with pytest.raises(FileNotFoundError, match=r"\*.jsonl"):
    data.read_documents([str(tmp_path / "*.jsonl")])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"text": oops}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
    data.read_documents(str(bad))
  bad.write_text('{"text": "ok"}\n\n{"other": "x"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:3: no key 'text'"):
    data.read_documents(str(bad))
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported file type"):
    data.read_documents(str(tmp_path / "x.csv"))


def test_bpe_training_is_deterministic_and_round_trips(text):
  docs = text.split("\n\n")
  a, b = train_bpe_tokenizer(docs, 320), train_bpe_tokenizer(iter(docs), 320)
  assert a.tok.to_str() == b.tok.to_str()
  assert a.vocab_size == 320
  assert (a.bos_id, a.eos_id, a.pad_id) == (0, 1, 2)
  assert a.token_text(a.bos_id) == "<|bos|>"
  sample = "Whence, O Juliet? ünïcødé\n  tabs\t"
  assert a.decode(a.encode(sample)) == sample
  assert a.encode(sample)[0] == a.bos_id and a.encode(sample, add_bos=False)[0] != a.bos_id
  with pytest.raises(ValueError, match="vocab_size"):
    train_bpe_tokenizer(docs, 100)


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
  tokenizer.save(str(tmp_path))
  loaded = type(tokenizer).load(str(tmp_path))
  assert loaded.encode("To be, or not") == tokenizer.encode("To be, or not")
  assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)


def test_unigram_entropy():
  assert unigram_entropy([[0, 1], [2, 3]]) == pytest.approx(math.log(4))
  assert unigram_entropy([[5, 5, 5]]) == 0.0
  counts = collections.Counter({0: 3, 1: 1})
  want = -sum(c / 4 * math.log(c / 4) for c in counts.values())
  assert unigram_entropy([[0, 0, 1], [0]]) == pytest.approx(want)
  with pytest.raises(ValueError):
    unigram_entropy([[]])


def test_a_bad_record_does_not_stop_tokenizer_training(tmp_path):
  # An alignment run's tokenizer is trained on its records' text before its task reads them:
  # a line that does not parse is the task's to skip and count (align/datasets.py), as
  # docs/alignment.md says, not the tokenizer's to fail on (issue 56). Pretraining's own
  # reading still refuses it, naming the line.
  path = tmp_path / "chat.jsonl"
  good = [json.dumps({"chosen": f"Human: question {i}?\n\nAssistant: answer {i}."})
          for i in range(40)]
  path.write_text("\n".join(good[:20] + ['{"chosen": broken'] + good[20:]) + "\n")
  config = base_config()
  config.data.path, config.data.text_key = str(path), "chosen"
  config.tokenizer.train_vocab_size = 300
  tokenizer = resolve_tokenizer(config, str(tmp_path / "run"))
  assert tokenizer.vocab_size == 300
  with pytest.raises(ValueError, match=r"chat.jsonl:21: invalid JSON"):
    data.load_split(config.data, "train")
