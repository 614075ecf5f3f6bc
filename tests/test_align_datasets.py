"""align/datasets.py: hash splits, pair and SFT grain pipelines, iterator state, reports."""

import gzip
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deps
from align import data as D
from align import datasets as DS
from train.assets import read_manifest
from test_align_data import CHATML, byte_tokenizer  # tests/ is on pytest's pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test.jsonl.gz")
HH_SLICE = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-slice.jsonl")
HH_CLEAN = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-decontam", "v1")
HH_DECONTAM = os.path.join(HH_CLEAN, "data.jsonl")
T = 48


@pytest.fixture(scope="module")
def tok():
  return byte_tokenizer(CHATML)


def _pair(i):
  """A preference record whose texts are unique to i (so pairs are identifiable)."""
  return {"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}" + "!" * (i % 3)}


@pytest.fixture(scope="module")
def pairs(tok):
  out = []
  for i in range(11):
    p = D.pair_from_record(_pair(i))
    chosen, rejected, _ = D.tokenize_pair(tok, p.prompt, p.chosen, p.rejected, T)
    out.append((chosen, rejected))
  return out


@pytest.fixture(scope="module")
def sft(tok):
  msgs = [[{"role": "user", "content": "hi " * (i % 4) + str(i)},
           {"role": "assistant", "content": f"a{i}"}] for i in range(13)]
  return [D.tokenize_sft(tok, m, T) for m in msgs]


def _take(ds, n):
  return list(itertools.islice(iter(ds), n))


def _key(ids_N, mask_N):
  return tuple(int(x) for x in ids_N), tuple(int(x) for x in mask_N)


def _ids(batch, b, side="chosen"):
  """Row b's one segment (a pair's response row) as its example's ids."""
  cols = batch[f"{side}_segment_ids"][b] != 0
  return tuple(int(x) for x in np.concatenate([batch[f"{side}_inputs"][b][:1],
                                               batch[f"{side}_targets"][b][cols]]))


def _write(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


# --- Splits and loaders ---


def test_hash_split_is_disjoint_covering_and_stable(tmp_path):
  items = [(f"f:{i}", _pair(i)) for i in range(200)]
  train = [w for w, _ in DS.split_records(items, "train", 0.25)]
  val = [w for w, _ in DS.split_records(items, "validation", 0.25)]
  assert not set(train) & set(val) and sorted(train + val) == sorted(w for w, _ in items)
  assert 20 < len(val) < 80
  # Key order and file order do not matter.
  shuffled = [(w, dict(reversed(list(r.items())))) for w, r in reversed(items)]
  assert sorted(w for w, _ in DS.split_records(shuffled, "validation", 0.25)) == sorted(val)
  with pytest.raises(ValueError):
    list(DS.split_records(items, "test", 0.25))


def test_loaders_split_and_report(tmp_path, tok):
  path = str(tmp_path / "p.jsonl")
  _write(path, [_pair(i) for i in range(40)] + [{"chosen": "x"}])
  cfg = {"path": path, "val_fraction": 0.3, "max_len": T}
  train, rep_t = DS.load_pair_split(cfg, tok, "train")
  val, rep_v = DS.load_pair_split(cfg, tok, "validation")
  assert rep_t.kept + rep_v.kept == 40 and rep_t.kept == len(train) and val
  assert rep_t.skipped["missing_fields"] + rep_v.skipped["missing_fields"] == 1
  everything, _ = D.load_pairs(path, tok, T)
  keys = lambda ps: {tuple(c[0]) for c, _ in ps}  # noqa: E731
  assert keys(train) | keys(val) == keys(everything) and not keys(train) & keys(val)
  # An explicit validation file replaces the hash split; both are used whole.
  vpath = str(tmp_path / "v.jsonl")
  _write(vpath, [{"prompt": "q", "response": "r"}, {"prompt": "s", "response": "t"}])
  cfg = {"path": vpath, "val_fraction": 0.5, "max_len": T, "validation_path": vpath}
  assert len(DS.load_sft_split(cfg, tok, "validation")[0]) == 2
  assert len(DS.load_sft_split(cfg, tok, "train")[0]) == 2
  with pytest.raises(FileNotFoundError, match="nope"):
    DS.load_sft_split({**cfg, "validation_path": str(tmp_path / "nope*.jsonl")}, tok,
                      "validation")


def test_write_report(tmp_path):
  report = D.DataReport(kept=3)
  report.skip(D.BadRecord("too_long", "long"), "f:1")
  path = DS.write_report(str(tmp_path / "w"), "train", report)
  assert path == str(tmp_path / "w" / "data_report_train.json")
  got = json.load(open(path))
  assert got["kept"] == 3 and got["skipped/too_long"] == 1 and got["samples"]["too_long"]
  assert os.listdir(tmp_path / "w") == ["data_report_train.json"]


# --- Pairs ---


def test_pair_batches_keep_pairs_aligned_and_join_to_pair_batch(pairs):
  ds = DS.pair_dataset(pairs, batch_size=4, seq_len=T, split="train", seed=0)
  batch = next(iter(ds))
  assert set(batch) == set(DS.PAIR_FIELDS)
  assert all(v.shape == (4, T) and v.dtype == np.int32 for v in batch.values())
  # Recover which pairs the rows are; join_pairs must then equal pair_batch on them.
  index = {tuple(int(x) for x in c[0]): i for i, (c, _) in enumerate(pairs)}
  rows = [index[_ids(batch, b)] for b in range(4)]
  expected = D.pair_batch([pairs[i] for i in rows], T)
  joined = DS.join_pairs(batch)
  for k in D.FIELDS:
    np.testing.assert_array_equal(joined[k], expected[k])
  jitted = jax.jit(DS.join_pairs)({k: jnp.asarray(v) for k, v in batch.items()})
  np.testing.assert_array_equal(np.asarray(jitted["loss_mask"]), expected["loss_mask"])
  np.testing.assert_array_equal(DS.pair_valid(batch), np.ones(4, np.float32))


def test_pair_validation_pads_and_covers_each_pair_once(pairs):
  ds = DS.pair_dataset(pairs, batch_size=4, seq_len=T, split="validation", seed=0)
  batches = list(ds)
  assert len(batches) == 3  # 11 pairs -> 12 rows
  joined = D.pair_batch(pairs, T)
  got = np.concatenate([DS.join_pairs(b)["targets"][:4] for b in batches])
  np.testing.assert_array_equal(got[:11], joined["targets"][:11])  # unshuffled, in order
  np.testing.assert_array_equal(DS.pair_valid(batches[-1]), [1, 1, 1, 0])
  assert all(not v[3].any() for v in batches[-1].values())


@pytest.mark.parametrize("split", ["train", "validation"])
def test_pair_process_shards_are_disjoint_and_cover(pairs, split):
  shards = []
  for p in range(3):
    ds = DS.pair_dataset(pairs, batch_size=2, seq_len=T, split=split, seed=1,
                         process_index=p, process_count=3)
    # Train: the first epoch is 11 pairs, 3 or 4 per process (one batch of 2 each is safe).
    got = list(ds) if split == "validation" else _take(ds, 1)
    if split == "validation":
      assert len(got) == 2  # ceil(11 / (3 * 2)) batches on every process
    shards.append([_ids(b, r) for b in got for r in range(2) if b["chosen_segment_ids"][r, 0]])
  flat = [k for s in shards for k in s]
  assert len(flat) == len(set(flat))
  if split == "validation":
    assert set(flat) == {tuple(int(x) for x in c[0]) for c, _ in pairs}


# --- SFT ---


def _segments(batch):
  """(ids, mask) of every segment in a packed batch, rebuilt as an example's arrays."""
  out = []
  for r in range(batch["inputs"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg != 0]):
      cols = np.flatnonzero(seg == s)
      assert (np.diff(cols) == 1).all()  # contiguous
      np.testing.assert_array_equal(batch["positions"][r, cols], np.arange(len(cols)))
      ids = np.concatenate([batch["inputs"][r, cols[:1]], batch["targets"][r, cols]])
      out.append(_key(ids, np.concatenate([[0], batch["loss_mask"][r, cols]])))
  return out


def test_sft_validation_rows_hold_every_example_once_with_its_mask(sft):
  batches = list(DS.sft_dataset(sft, batch_size=2, seq_len=T, split="validation", seed=0))
  assert all(v.shape == (2, T) and v.dtype == np.int32 for b in batches for v in b.values())
  assert set(batches[0]) == set(D.FIELDS)
  segs = [s for b in batches for s in _segments(b)]
  # mask[0] is never a target (it belongs to the prompt), so the rebuilt mask matches.
  assert sorted(segs) == sorted(_key(ids, mask) for ids, mask in sft)
  for b in batches:  # loss only on response tokens, never on padding
    assert not (b["loss_mask"] & (b["segment_ids"] == 0)).any()
  packed = D.pack_sft(sft, T)
  assert sorted(_segments(packed)) == sorted(segs)


def test_sft_train_shards_and_packs(sft):
  seen = []
  for p in range(2):
    ds = DS.sft_dataset(sft, batch_size=2, seq_len=T, split="train", seed=3,
                        process_index=p, process_count=2, num_packing_bins=2)
    batches = _take(ds, 2)
    assert all(v.shape == (2, T) for b in batches for v in b.values())
    seen.append(set(s for b in batches for s in _segments(b)))
  examples = {_key(ids, mask) for ids, mask in sft}
  assert seen[0] <= examples and seen[1] <= examples and seen[0] and seen[1]


# --- Iterator state ---


@pytest.mark.parametrize("kind", ["pair", "sft"])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_iterator_state_round_trip(pairs, sft, kind, split):
  make = DS.pair_dataset if kind == "pair" else DS.sft_dataset
  ds = make(pairs if kind == "pair" else sft, batch_size=2, seq_len=T, split=split, seed=5)
  it = iter(ds)
  for _ in range(2):
    next(it)
  state = it.get_state()
  after = _take(it, 2)
  _take(it, 1)
  it.set_state(state)
  again = _take(it, 2)
  assert len(after) == len(again) == 2
  for a, b in zip(after, again):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  fresh = iter(make(pairs if kind == "pair" else sft, batch_size=2, seq_len=T, split=split,
                    seed=5))
  fresh.set_state(json.loads(json.dumps(state)) if isinstance(state, dict) else state)
  np.testing.assert_array_equal(next(fresh)["loss_mask" if kind == "sft" else
                                           "chosen_loss_mask"],
                                after[0]["loss_mask" if kind == "sft" else "chosen_loss_mask"])


# --- The bundled hh-rlhf file with SmolLM2's tokenizer ---


@pytest.fixture(scope="module")
def smollm_tok():
  path = deps.smollm()
  from gguf import GGUFReader

  from models.gguf_tokenizer import tokenizer_from_gguf
  return tokenizer_from_gguf(GGUFReader(path), path)


def test_bundled_slice_is_the_head_of_the_decontaminated_file():
  """The slice: the decontaminated asset's first 30 rows (raw lines 1-30; raw line 0 is an
  AlpacaEval prompt) and 5 bad raw lines, byte for byte; the asset is the raw file less the
  lines its manifest says it dropped."""
  with gzip.open(HH, "rt", encoding="utf-8") as f:
    full = f.read().splitlines()
  with open(HH_SLICE, encoding="utf-8") as f:
    piece = f.read().splitlines()
  with open(os.path.join(HH_CLEAN, "data.jsonl"), encoding="utf-8") as f:
    clean = f.read().splitlines()
  dropped = set(read_manifest(HH_CLEAN)["decontaminated"]["dropped_rows"])
  assert len(full) == 2354 and clean == [x for i, x in enumerate(full) if i not in dropped]
  assert piece[:30] == clean[:30] == full[1:31]
  assert piece[30:] == [full[i] for i in (120, 168, 355, 721, 740)]


def test_hh_rlhf_loads_with_smollm2_tokenizer(smollm_tok, tmp_path):
  cfg = {"path": HH_DECONTAM, "val_fraction": 0.05, "max_len": 1024}
  train, rep_t = DS.load_pair_split(cfg, smollm_tok, "train")
  val, rep_v = DS.load_pair_split(cfg, smollm_tok, "validation")
  assert rep_t.kept > 2000 and 50 < rep_v.kept < 200
  rep_t.check()
  assert rep_t.total + rep_v.total == 2354 - 144
  with pytest.raises(ValueError, match="138 of 2237 rows"):  # the raw file: AlpacaEval rows
    DS.load_pair_split({**cfg, "path": HH}, smollm_tok, "train")
  batch = next(iter(DS.pair_dataset(train, batch_size=4, seq_len=1024, split="train",
                                    seed=0)))
  assert DS.join_pairs(batch)["inputs"].shape == (8, 1024)
  path = DS.write_report(str(tmp_path), "hh_train", rep_t)
  assert json.load(open(path))["kept"] == rep_t.kept


def test_pairs_sharing_a_conversation_opening_land_on_one_side():
  from align.datasets import record_key
  opening = "\n\nHuman: How do I bake bread?\n\nAssistant: Flour, water, yeast."
  a = {"chosen": opening + "\n\nHuman: And salt?\n\nAssistant: Yes.",
       "rejected": opening + "\n\nHuman: And salt?\n\nAssistant: No."}
  b = {"chosen": opening + "\n\nHuman: How long?\n\nAssistant: An hour.",
       "rejected": opening + "\n\nHuman: How long?\n\nAssistant: A day."}
  assert record_key(a) == record_key(b) == "How do I bake bread?"
  assert record_key({"prompt": " Hi ", "chosen": "a", "rejected": "b"}) == "Hi"
  assert record_key({"messages": [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "q"}]}) == "q"
  assert record_key({"chosen": 3}).startswith("{")  # unusable: its canonical JSON
