"""train/decontam.py: GPT-3 style n-gram overlap against the protected evaluation sets
(data/protected_evals.json), and the training-run hook: planted evaluation rows make a real
run refuse and name them; data.decontam.allow lets it proceed."""

import csv
import gzip
import json
import os
import shutil

import pytest

from train import assets
from align import datasets as DS
from train import decontam as DC
from align.sft import SFTTask
from train.defaults import base_config
from test_align_data import CHATML, byte_tokenizer  # tests/ is on pytest's pythonpath
from train import data as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test.jsonl.gz")
HH_SLICE = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-slice.jsonl")
HH_CLEAN = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-decontam", "v1")
SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare", "input.txt")
TRUTHFULQA = os.path.join(REPO, "data", "truthfulqa", "TruthfulQA.csv")
# 20 tokens once normalized.
EVAL_TEXT = ("Explain, in plain words, why the sky looks blue on a clear day and red at sunset "
             "near the sea.")


def _registry(tmp_path, rows, fields=("text",), name="toy"):
  """A registry with one jsonl eval set of `rows` (dicts)."""
  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  reg = tmp_path / "registry.json"
  reg.write_text(json.dumps({"eval_sets": [{"name": name, "path": str(path), "format": "jsonl",
                                            "fields": list(fields), "licence": "test"}]}))
  return str(reg)


def test_normalize_lowercases_and_deletes_punctuation():
  assert DC.normalize("What's THE time?  It's 5-ish...\n(Really!)") == \
      ["whats", "the", "time", "its", "5ish", "really"]


def test_13gram_overlap_is_found_and_12_is_not(tmp_path):
  reg = _registry(tmp_path, [{"text": "unrelated words only here"}, {"text": EVAL_TEXT}])
  index = DC.build_index(registry=reg)
  tokens = DC.normalize(EVAL_TEXT)
  assert len(tokens) == 20 and index.rows == {"toy": 2} and index.skipped_short == {"toy": 1}
  t13 = "Prefix text. " + " ".join(tokens[3:16]).upper() + "! suffix"
  t12 = "Prefix text. " + " ".join(tokens[3:15]) + " suffix"
  report = DC.check_rows(["clean row", t12, t13], index, n=13)
  assert [(o.row, o.eval_set, o.eval_row) for o in report.overlaps] == [(2, "toy", 1)]
  assert report.overlaps[0].ngram == " ".join(tokens[3:16])
  assert report.overlaps[0].eval_text == EVAL_TEXT and report.overlaps[0].matches == 1
  assert report.fraction == pytest.approx(1 / 3)
  # n is configurable: 12 shared tokens hold 8 distinct 5-grams.
  small = DC.build_index(registry=reg, n=5, min_tokens=5)
  got = DC.check_rows([t12], small).overlaps
  assert len(got) == 1 and got[0].matches == 8
  with pytest.raises(ValueError, match="built with n=5"):
    DC.check_rows([t12], small, n=13)


def test_short_eval_rows_match_whole_and_tiny_ones_are_skipped(tmp_path):
  short = "Can a dog really eat chocolate without getting sick?"  # 9 tokens < 13
  reg = _registry(tmp_path, [{"text": short}, {"text": "Nothing happens."}])
  index = DC.build_index(registry=reg)
  assert index.skipped_short == {"toy": 1}  # "nothing happens": under min_tokens=8
  rows = ["My question: can a dog really eat chocolate without getting sick? Thanks.",
          "can a dog really eat chocolate without getting",   # 8 of the 9 tokens
          "I asked and nothing happens at all."]
  report = DC.check_rows(rows, index)
  assert [o.row for o in report.overlaps] == [0]
  assert report.overlaps[0].ngram == "can a dog really eat chocolate without getting sick"
  assert DC.check_rows(rows, DC.build_index(registry=reg, min_tokens=2)).overlaps[1].row == 2


def test_ngrams_never_span_two_strings_of_a_row(tmp_path):
  index = DC.build_index(registry=_registry(tmp_path, [{"text": EVAL_TEXT}]))
  tokens = DC.normalize(EVAL_TEXT)
  split_row = {"a": " ".join(tokens[:7]), "b": " ".join(tokens[7:14])}
  assert DC.check_rows([split_row], index).overlaps == []
  assert len(DC.check_rows([" ".join(tokens[:14])], index).overlaps) == 1


def test_registry_holds_the_public_eval_sets():
  entries = {e["name"]: e for e in DC.load_registry()}
  assert set(entries) >= {"alpaca-eval", "mt-bench", "truthfulqa", "xstest", "advbench",
                          "jbb-behaviors", "self-instruct-user", "unanswerable"}
  assert entries["truthfulqa"]["fields"] == ["Question", "Best Answer"]
  assert all(e.get("licence") for e in entries.values())
  index = DC.build_index()
  assert index.rows == {"alpaca-eval": 805, "mt-bench": 80, "truthfulqa": 817, "xstest": 450,
                        "advbench": 520, "jbb-behaviors": 100, "self-instruct-user": 252,
                        "unanswerable": 60}
  assert index.n == 13 and index.size > 15000


def test_bad_registries_are_named(tmp_path):
  def reg(doc):
    p = tmp_path / "r.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)

  ok = {"name": "a", "path": "x.jsonl", "format": "jsonl", "fields": ["t"]}
  for doc, message in (("{oops", "bad JSON"), ({"sets": []}, "expected"),
                       ({"eval_sets": [ok, ok]}, "registered twice"),
                       ({"eval_sets": [ok | {"format": "xml"}]}, "'format' 'xml'"),
                       ({"eval_sets": [ok | {"fields": []}]}, "non-empty 'fields'"),
                       ({"eval_sets": [{"path": "x"}]}, "non-empty string 'name'")):
    with pytest.raises(ValueError, match=message):
      DC.load_registry(reg(doc))
  with pytest.raises(ValueError, match=r"protected eval set 'a': .*x\.jsonl is missing"):
    DC.build_index(registry=reg({"eval_sets": [ok]}))
  with pytest.raises(ValueError, match="not a name in"):
    DC.build_index("nope", registry=reg({"eval_sets": [ok]}))
  assert DC.build_index("", registry=reg("{oops")).sets == []  # empty: disabled


def test_eval_assets_are_protected(tmp_path):
  """A pair builder's held-out prompts, written as an asset of kind "eval", registered (or
  named directly in eval_sets), protect their rows."""
  held_out = [{"prompt": "Describe the steps to repot a large fiddle leaf fig without "
                         "damaging its roots in early spring."}]
  vdir = assets.write_asset(str(tmp_path / "assets"), "heldout", held_out, kind="eval",
                            lineage={})
  reg = str(tmp_path / "registry.json")
  shutil.copy(DC.REGISTRY, reg)
  entry = DC.register_asset(os.path.dirname(vdir), registry=reg, fields=["prompt"])
  assert entry["name"] == "heldout" and entry["fields"] == ["prompt"]
  assert [e["name"] for e in DC.load_registry(reg)][-1] == "heldout"
  row = "Hi! " + held_out[0]["prompt"].lower()
  index = DC.build_index(registry=reg)
  assert "heldout" in index.sets and index.rows["heldout"] == 1
  assert DC.check_rows([row], index).overlaps[0].eval_set == "heldout"
  direct = DC.build_index([os.path.dirname(vdir)], registry=reg)
  assert direct.sets == [os.path.dirname(vdir)] and DC.check_rows([row], direct).overlaps
  pool = assets.write_asset(str(tmp_path / "assets"), "pool", held_out, kind="prompts",
                            lineage={})
  with pytest.raises(ValueError, match="only kind 'eval'"):
    DC.register_asset(pool, registry=reg)
  # the same from the command line
  from cli.data import main as data_main
  reg2 = str(tmp_path / "registry2.json")
  shutil.copy(DC.REGISTRY, reg2)
  data_main(["register", os.path.dirname(vdir), "--name", "heldout2", "--registry", reg2])
  assert "heldout2" in DC.build_index(registry=reg2).sets
  with pytest.raises(SystemExit, match="only kind 'eval'"):
    data_main(["register", pool, "--registry", reg2])


def test_enforce_threshold_allow_and_disable(tmp_path, capsys):
  reg = _registry(tmp_path, [{"text": EVAL_TEXT}])
  rows = [f"clean row {i}" for i in range(9)] + ["quote: " + EVAL_TEXT]
  with pytest.raises(ValueError, match=r"1 of 10 rows .*\{'toy': 1\}[\s\S]*row 9: toy row 0"):
    DC.enforce(rows, {}, registry=reg)
  with pytest.raises(ValueError, match="1 of 10 rows"):
    DC.enforce(rows, {"max_overlap_rows": 0.05}, registry=reg)
  assert len(DC.enforce(rows, {"max_overlap_rows": 0.1}, registry=reg).overlaps) == 1
  report = DC.enforce(rows, {"allow": True}, labels=[f"f:{i}" for i in range(10)],
                      registry=reg)
  assert len(report.overlaps) == 1
  err = capsys.readouterr().err
  assert "WARNING" in err and "1 of 10 rows" in err and "f:9: toy row 0" in err
  assert DC.enforce(rows, {"eval_sets": ""}, registry=reg) is None
  with pytest.raises(ValueError, match="unknown key"):
    DC.enforce(rows, {"max_overlap": 1}, registry=reg)
  with pytest.raises(ValueError, match="must be in"):
    DC.enforce(rows, {"max_overlap_rows": 2.0}, registry=reg)
  defaults = base_config().data.decontam.to_dict()
  assert defaults == {"n": 13, "min_tokens": 8, "max_overlap_rows": 0.0, "allow": False,
                      "eval_sets": "default"}


def test_bundled_training_data_does_not_trip_the_check():
  """tinyshakespeare is clean. hh-rlhf helpful-base test really overlaps AlpacaEval (144 rows:
  AlpacaEval's helpful_base prompts come from it): there is no waiver, so training on the raw
  file is refused, and its decontaminated asset (what the experiments train on) is clean."""
  cfg = base_config().data
  cfg.path, cfg.val_fraction = SHAKESPEARE, 0.0
  assert len(data_lib.load_split(cfg, "train")) == 7222  # checked inside, clean
  assert DC.check_documents(cfg, data_lib.load_split(cfg, "train"), [SHAKESPEARE]).overlaps == []
  with gzip.open(HH, "rt") as f:
    items = [(f"{HH}:{i}", json.loads(line)) for i, line in enumerate(f, 1)]
  with pytest.raises(ValueError, match=r"144 of 2354 rows .*'alpaca-eval': 144"):
    DC.check_records({"path": HH}, items)
  clean = assets.read_asset(HH_CLEAN)
  report = DC.check_records({"path": HH_CLEAN}, [(f"{HH_CLEAN}:{i}", r) for i, r in
                                                 enumerate(clean, 1)])
  assert report.rows == len(clean) == 2354 - 144 and report.overlaps == []
  with open(HH_SLICE) as f:
    assert DC.check_rows([json.loads(line) for line in f], DC.build_index()).overlaps == []


def test_the_registry_holds_no_waiver_and_refuses_one(tmp_path):
  with open(DC.REGISTRY) as f:
    assert set(json.load(f)) == {"about", "schema_version", "eval_sets"}
  doc = {"eval_sets": [], "acknowledged_overlaps": [
      {"source": "x.jsonl", "sha256": "0" * 64, "eval_set": "alpaca-eval", "why": "known"}]}
  reg = tmp_path / "r.json"
  reg.write_text(json.dumps(doc))
  with pytest.raises(ValueError, match="waivers are gone.*meshlm data decontam"):
    DC.load_registry(str(reg))


def _sha(path):
  return assets.sha256_file(path)


def test_decontaminated_asset_drops_and_counts_overlaps(tmp_path, capsys):
  """Planted evaluation texts are dropped from the asset and counted in its manifest, the
  same rows every run; the evaluation file is not touched; `meshlm data show` prints the
  count."""
  reg = _registry(tmp_path, [{"text": "unrelated words only here"}, {"text": EVAL_TEXT}])
  eval_file, eval_sha = str(tmp_path / "toy.jsonl"), _sha(str(tmp_path / "toy.jsonl"))
  rows = [{"chosen": f"clean row {i}", "rejected": "no"} for i in range(6)]
  rows[1]["chosen"] = "Quoting: " + EVAL_TEXT
  rows[4]["rejected"] = EVAL_TEXT.upper()
  src = tmp_path / "train.jsonl.gz"
  with gzip.open(src, "wt") as f:
    f.write(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
  root = str(tmp_path / "assets")
  first = DC.write_decontaminated(str(src), root, "train-clean", registry=reg)
  second = DC.write_decontaminated(str(src), root, "train-clean", registry=reg)
  m1, m2 = assets.read_manifest(first), assets.read_manifest(second)
  d = m1["decontaminated"]
  # Line numbers are 0-based lines of the file: the blank line 1 is no row.
  assert (d["source_rows"], d["kept"], d["dropped"], d["dropped_rows"]) == (6, 4, 2, [2, 5])
  assert d["dropped_by_set"] == {"toy": 2} and d["n"] == 13 and "13-gram" in d["method"]
  assert d["against"] == [{"name": "toy", "path": eval_file, "rows": 2, "sha256": eval_sha}]
  assert assets.read_asset(first) == [rows[i] for i in (0, 2, 3, 5)]
  assert m2["decontaminated"] == d and m2["content_sha256"] == m1["content_sha256"]
  assert m1["lineage"]["source"]["sha256"] == _sha(str(src)) and m1["kind"] == "train"
  assert _sha(eval_file) == eval_sha and DC.build_index(registry=reg).rows == {"toy": 2}
  # Training on the asset passes the check; on the source it is refused.
  assert DC.enforce(assets.read_asset(first), registry=reg).overlaps == []
  with pytest.raises(ValueError, match="2 of 6 rows"):
    DC.enforce(rows, registry=reg)
  from cli.data import main as data_main
  capsys.readouterr()
  data_main(["show", first, "--rows", "0"])
  assert "decontaminated: dropped 2 of 6 source rows {'toy': 2}, kept 4" in \
      capsys.readouterr().out


def test_decontamination_refuses_bad_input_and_bad_manifests(tmp_path):
  reg = _registry(tmp_path, [{"text": EVAL_TEXT}])
  root = str(tmp_path / "assets")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"chosen": "a"}\n{oops\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: bad JSON"):
    DC.write_decontaminated(str(bad), root, "x", registry=reg)
  bad.write_text('["a list"]\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:1: a list, not a JSON object"):
    DC.write_decontaminated(str(bad), root, "x", registry=reg)
  with pytest.raises(ValueError, match="no such file"):
    DC.write_decontaminated(str(tmp_path / "none.jsonl"), root, "x", registry=reg)
  bad.write_text('{"chosen": "a"}\n')
  with pytest.raises(ValueError, match="selects no evaluation set"):
    DC.write_decontaminated(str(bad), root, "x", eval_sets="", registry=reg)
  vdir = DC.write_decontaminated(str(bad), root, "x", registry=reg)
  mpath = os.path.join(vdir, assets.MANIFEST)
  with open(mpath) as f:
    manifest = json.load(f)
  manifest["decontaminated"]["dropped"] = 3
  with open(mpath, "w") as f:
    json.dump(manifest, f)
  with pytest.raises(ValueError, match="decontaminated counts do not add up"):
    assets.read_manifest(vdir)


def test_the_default_asset_name_keeps_dots_inside_the_file_name():
  from cli.data import stem
  assert stem("/d/helpful-base-test.jsonl.gz") == "helpful-base-test"
  assert stem("hh.v2.train.jsonl") == "hh.v2.train"
  assert stem("rows.json") == "rows"


@pytest.mark.parametrize("name,rows,dropped", [("helpful-base-test", 2354, 144),
                                               ("helpful-rejection-sampled-test", 2749, 61)])
def test_committed_hh_asset_is_what_the_command_writes(tmp_path, name, rows, dropped):
  """data/hh-rlhf/NAME-decontam/v1 equals a fresh `meshlm data decontam` of the raw file: the
  same rows dropped (all AlpacaEval), the same content; AlpacaEval's helpful_base subset stays
  whole in the evaluation set."""
  from cli.data import main as data_main
  raw = os.path.join(REPO, "data", "hh-rlhf", f"{name}.jsonl.gz")
  committed = assets.read_manifest(os.path.join(REPO, "data", "hh-rlhf", f"{name}-decontam", "v1"))
  data_main(["decontam", raw, str(tmp_path)])
  fresh = assets.read_manifest(str(tmp_path / f"{name}-decontam"))
  assert fresh["content_sha256"] == committed["content_sha256"]
  strip = lambda d: {**d, "against": [{k: v for k, v in a.items() if k != "path"}
                                      for a in d["against"]]}
  assert strip(fresh["decontaminated"]) == strip(committed["decontaminated"])
  d = committed["decontaminated"]
  assert (d["source_rows"], d["dropped"], d["dropped_by_set"]) == (rows, dropped,
                                                                  {"alpaca-eval": dropped})
  assert committed["lineage"]["source"]["sha256"] == _sha(raw)
  with open(os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")) as f:
    alpaca = json.load(f)
  assert len(alpaca) == 805 and sum(r["dataset"] == "helpful_base" for r in alpaca) == 129
  sha = {a["name"]: a["sha256"] for a in d["against"]}
  assert sha["alpaca-eval"] == _sha(os.path.join(REPO, "data", "alpaca-eval",
                                                 "text_davinci_003_model_outputs.json"))


def _planted_file(tmp_path):
  """29 clean hh-rlhf slice records; 5 of them get a TruthfulQA question appended to their
  first human turn (questions of >= 8 tokens, so they are protected)."""
  with open(TRUTHFULQA, encoding="utf-8-sig", newline="") as f:
    questions = [r["Question"] for r in csv.DictReader(f)]
  picked = [(i, q) for i, q in enumerate(questions) if len(DC.normalize(q)) >= 8][:5]
  with open(HH_SLICE) as f:
    records = [json.loads(line) for line in f][:29]
  lines = {}
  for slot, (_, q) in zip((2, 7, 12, 17, 22), picked):
    rec = records[slot]
    for side in ("chosen", "rejected"):
      head, sep, rest = rec[side].partition("\n\nAssistant:")
      rec[side] = f"{head} Also, {q}{sep}{rest}"
    lines[slot + 1] = q
  path = tmp_path / "planted.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path), picked, lines


def test_planted_eval_rows_make_a_real_run_refuse_and_name_them(tmp_path):
  from test_align_tasks import tiny
  from train.loop import train
  path, picked, lines = _planted_file(tmp_path)
  config = tiny(**{"data.path": path, "data.val_fraction": 0.0})
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError) as e:
    train(config, workdir, task=SFTTask(config, workdir))
  msg = str(e.value)
  assert "5 of 29 rows" in msg and "{'truthfulqa': 5}" in msg, msg
  for (eval_row, q), line in zip(picked, sorted(lines)):
    # hh_tiny trains its tokenizer on the data first: train/data.py's hook names documents.
    assert f"{path} document {line - 1}: truthfulqa row {eval_row} " in msg
    assert repr(" ".join(DC.normalize(q)[:13])) in msg or \
        repr(" ".join(DC.normalize(q))) in msg
  assert "--config.data.decontam.allow=True" in msg
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_planted_rows_through_the_align_loaders_refuse_then_allow(tmp_path, capsys):
  """The SFT and pair loaders the loop calls (align/datasets.py) name rows as file:line and
  proceed with data.decontam.allow=True."""
  path, _, lines = _planted_file(tmp_path)
  tok = byte_tokenizer(CHATML)
  cfg = {"path": path, "val_fraction": 0.0, "validation_path": "", "max_len": 4096,
         "drop_turns": True, "decontam": base_config().data.decontam}
  for load in (DS.load_sft_split, DS.load_pair_split):
    with pytest.raises(ValueError) as e:
      load(cfg, tok, "train")
    msg = str(e.value)
    assert "5 of 29 rows" in msg
    for line in lines:
      assert f"{path}:{line}: truthfulqa row " in msg
    cfg["decontam"] = {**cfg["decontam"], "allow": True}
    items, report = load(cfg, tok, "train")
    assert len(items) == report.kept == 29
    err = capsys.readouterr().err
    assert "WARNING" in err and "5 of 29 rows" in err and "allow=True" in err
    cfg["decontam"] = base_config().data.decontam
  # The validation split is not training data: never checked.
  assert DS.load_sft_split({**cfg, "val_fraction": 0.0}, tok, "validation")[0] == []


def test_a_real_run_with_allow_proceeds(tmp_path, capsys):
  from test_align_tasks import metrics, tiny
  from train.loop import train
  path, _, _ = _planted_file(tmp_path)
  config = tiny(steps=2, **{"data.path": path, "data.val_fraction": 0.0})
  config.data.decontam.allow = True
  workdir = str(tmp_path / "run")
  last = train(config, workdir, task=SFTTask(config, workdir))
  assert [m["step"] for m in metrics(workdir) if "loss" in m][-1] == 2
  assert last["loss"] > 0
  assert "5 of 29 rows" in capsys.readouterr().err  # the override is loud
