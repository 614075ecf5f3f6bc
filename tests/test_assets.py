"""train/assets.py and `meshlm data`: versioned writes, manifests and lineage, content-hash
checks, atomicity (a failed or racing write never leaves a visible half version), ls/show/diff."""

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

import deps
from train import assets
from cli.data import main as data_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MT_BENCH = os.path.join(REPO, "data", "mt-bench", "mt_bench_question.jsonl")
ROWS = [{"prompt": "Name three primes.", "id": 1, "tags": ["math"]},
        {"prompt": "Write a haiku.", "id": 2, "tags": [], "note": None}]


def test_write_read_roundtrip_with_manifest_and_lineage(tmp_path):
  lineage = {"sources": [assets.file_ref(MT_BENCH)], "seed": 3, "rubric": "helpful"}
  vdir = assets.write_asset(str(tmp_path), "pool", ROWS, kind="prompts", lineage=lineage,
                            command="meshlm pairs --config x.py")
  assert vdir == str(tmp_path / "pool" / "v1")
  assert sorted(os.listdir(vdir)) == ["data.jsonl", "manifest.json"]
  assert assets.read_asset(vdir) == ROWS
  m = assets.read_manifest(vdir)
  assert m["name"] == "pool" and m["version"] == 1 and m["kind"] == "prompts"
  assert m["schema_version"] == assets.SCHEMA_VERSION and m["format"] == "jsonl"
  assert m["rows"] == 2 and m["command"] == "meshlm pairs --config x.py"
  assert m["content_sha256"] == assets.sha256_file(os.path.join(vdir, "data.jsonl"))
  assert m["columns"] == {"prompt": "str", "id": "int", "tags": "list", "note": "null"}
  assert m["lineage"] == lineage
  ref = lineage["sources"][0]
  assert ref["bytes"] == os.path.getsize(MT_BENCH) and len(ref["sha256"]) == 64
  assert m["created"].endswith("+00:00")


def test_versions_latest_and_asset_ref(tmp_path):
  root = str(tmp_path)
  assert assets.latest_version(root, "pairs") is None
  v1 = assets.write_asset(root, "pairs", ROWS, kind="pairs", lineage={})
  v2 = assets.write_asset(root, "pairs", ROWS[:1], kind="pairs", lineage={"from": v1})
  assert v2.endswith(os.path.join("pairs", "v2"))
  assert assets.latest_version(root, "pairs") == v2
  assert assets.read_asset(os.path.join(root, "pairs")) == ROWS[:1]  # ROOT/NAME = latest
  ref = assets.asset_ref(os.path.join(root, "pairs"))
  assert ref == {"path": v2, "name": "pairs", "version": 2, "rows": 1,
                 "content_sha256": assets.read_manifest(v2)["content_sha256"]}
  assert assets.command_line()  # this process's command, never empty


def test_command_line_names_meshlm_and_no_host_path(monkeypatch, tmp_path):
  main_py = os.path.join(str(tmp_path), "repo", "cli", "main.py")
  for argv0 in ("/usr/local/bin/meshlm", main_py):
    monkeypatch.setattr(sys, "argv", [argv0, "data", "decontam", "a b.jsonl", "out"])
    assert assets.command_line() == "meshlm data decontam 'a b.jsonl' out"
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "argv", [str(tmp_path / "tools" / "make.py"), "--n", "3"])
  assert assets.command_line().endswith(" tools/make.py --n 3")


def test_parquet_roundtrip(tmp_path):
  deps.require("pyarrow")
  vdir = assets.write_asset(str(tmp_path), "pq", ROWS, kind="pairs", lineage={}, fmt="parquet")
  m = assets.read_manifest(vdir)
  assert m["file"] == "data.parquet" and m["format"] == "parquet"
  assert m["content_sha256"] == assets.sha256_file(os.path.join(vdir, "data.parquet"))
  rows = assets.read_asset(vdir)
  assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
  assert [r["tags"] for r in rows] == [["math"], []]


def test_hash_mismatch_missing_and_bad_manifest_are_named(tmp_path):
  vdir = assets.write_asset(str(tmp_path), "a", ROWS, kind="prompts", lineage={})
  data = os.path.join(vdir, "data.jsonl")
  with open(data, "a") as f:
    f.write(json.dumps({"prompt": "sneaked in"}) + "\n")
  with pytest.raises(ValueError, match=r"data\.jsonl: content sha256 .* does not match"):
    assets.read_asset(vdir)
  os.remove(data)
  with pytest.raises(ValueError, match="data file named by the manifest is missing"):
    assets.read_asset(vdir)
  with open(os.path.join(vdir, "manifest.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(ValueError, match=r"manifest\.json: bad JSON"):
    assets.read_manifest(vdir)
  with open(os.path.join(vdir, "manifest.json"), "w") as f:
    json.dump({"name": "a"}, f)
  with pytest.raises(ValueError, match="missing keys"):
    assets.read_asset(vdir)
  with pytest.raises(ValueError, match="no manifest.json and no complete versions"):
    assets.read_asset(str(tmp_path))
  with pytest.raises(ValueError, match="no such asset directory"):
    assets.read_asset(str(tmp_path / "nope"))


def test_bad_rows_and_arguments_are_refused_before_anything_is_written(tmp_path):
  root = str(tmp_path)
  for rows, message in (([1, 2], "row 0 is a int, not a dict"),
                        ([{"a": 1}, {"a": object()}], "row 1 is not JSON-serializable"),
                        ([{"a": float("nan")}], "row 0 is not JSON-serializable"),
                        ([{1: "x"}], "keys must be strings"),
                        ("abc", "sequence of dicts")):
    with pytest.raises(ValueError, match=message):
      assets.write_asset(root, "x", rows, kind="prompts", lineage={})
  for kwargs, message in ((dict(name="a/b"), "no slashes"), (dict(kind=""), "kind"),
                          (dict(fmt="csv"), "format"), (dict(lineage={"s": {1, 2}}), "lineage"),
                          (dict(extra={"rows": 3}), r"extra manifest fields \['rows'\]"),
                          (dict(extra={"x": {1}}), "extra is not JSON")):
    args = dict(name="x", kind="prompts", lineage={}) | kwargs
    with pytest.raises(ValueError, match=message):
      assets.write_asset(root, args.pop("name"), ROWS, **args)
  assert not os.path.exists(os.path.join(root, "x"))


def test_a_write_failing_midway_leaves_no_version(tmp_path):
  """Parquet conversion fails after the temp dir exists (mixed types in one column): the
  temp dir is removed and no version becomes visible."""
  deps.require("pyarrow")
  root = str(tmp_path)
  assets.write_asset(root, "m", ROWS, kind="prompts", lineage={})
  with pytest.raises(Exception):
    assets.write_asset(root, "m", [{"a": 1}, {"a": "x"}], kind="prompts", lineage={},
                       fmt="parquet")
  assert sorted(os.listdir(tmp_path / "m")) == ["v1"]
  # A crashed writer's leftovers (a temp dir, a version dir without manifest) stay invisible.
  os.makedirs(tmp_path / "m" / ".tmp-crashed")
  (tmp_path / "m" / ".tmp-crashed" / "data.jsonl").write_text('{"half": ')
  assert assets.latest_version(root, "m").endswith("v1")
  assert [e["version"] for e in assets.list_assets(root)] == [1]
  assert assets.read_asset(os.path.join(root, "m")) == ROWS


def _writer(args):
  root, k = args
  return [assets.write_asset(root, "race", [{"writer": k, "i": i}], kind="prompts",
                             lineage={}) for i in range(4)]


def test_racing_writers_get_distinct_complete_versions(tmp_path):
  with multiprocessing.get_context("spawn").Pool(2) as pool:
    dirs = sum(pool.map(_writer, [(str(tmp_path), 0), (str(tmp_path), 1)]), [])
  assert sorted(dirs) == sorted({str(tmp_path / "race" / f"v{k}") for k in range(1, 9)})
  rows = sorted((r["writer"], r["i"]) for d in dirs for r in assets.read_asset(d))
  assert rows == [(w, i) for w in (0, 1) for i in range(4)]
  assert [n for n in os.listdir(tmp_path / "race") if n.startswith(".")] == []


@pytest.fixture
def two_versions(tmp_path):
  root = str(tmp_path)
  src = assets.file_ref(MT_BENCH)
  v1 = assets.write_asset(root, "pool", [{"prompt": p} for p in "abcde"], kind="prompts",
                          lineage={"sources": [src], "seed": 0})
  v2 = assets.write_asset(root, "pool", [{"prompt": p} for p in "abdef"] + [{"prompt": "g",
                                                                            "w": 1.5}],
                          kind="prompts", lineage={"sources": [src], "seed": 1,
                                                   "teacher": "smollm2"})
  return root, v1, v2


def test_data_ls_show_diff(two_versions, capsys):
  root, v1, v2 = two_versions
  data_main(["ls", root])
  out = capsys.readouterr().out.splitlines()
  assert out[0].split() == ["name", "version", "kind", "rows", "created", "sha256"]
  h1, h2 = (assets.read_manifest(v)["content_sha256"][:12] for v in (v1, v2))
  assert out[1].split()[:4] == ["pool", "v1", "prompts", "5"] and out[1].endswith(h1)
  assert out[2].split()[:4] == ["pool", "v2", "prompts", "6"] and out[2].endswith(h2)

  data_main(["ls", os.path.join(root, "pool")])  # ROOT/NAME: that asset's versions
  assert [line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]] == ["v1", "v2"]

  data_main(["show", os.path.join(root, "pool"), "--rows", "2"])
  out = capsys.readouterr().out
  assert f"# {v2} (content hash verified)" in out
  assert '"teacher": "smollm2"' in out and '"sha256"' in out  # lineage shown
  assert "# first 2 of 6 rows" in out and out.rstrip().endswith('{"prompt": "b"}')

  data_main(["diff", v1, v2])
  out = capsys.readouterr().out
  assert "lineage.seed: 0 -> 1" in out and "lineage.teacher: added smollm2" in out
  assert "rows: 5 -> 6" in out and "columns.w: added (float)" in out
  assert "content_sha256: " in out and "version: 1 -> 2" in out
  assert "added 2, removed 1, unchanged 4" in out
  assert '+ {"prompt": "f"}' in out and '- {"prompt": "c"}' in out


def test_data_cli_errors_and_entry_point(two_versions):
  root, v1, v2 = two_versions
  with open(os.path.join(v1, "data.jsonl"), "a") as f:
    f.write("{}\n")
  with pytest.raises(SystemExit, match=r"meshlm data show: .*v1/data\.jsonl: content sha256"):
    data_main(["show", v1])
  # `python -m cli.main` is the program the `meshlm` entry point runs.
  cmd = [sys.executable, "-m", "cli.main", "data"]
  done = subprocess.run(cmd + ["diff", v2, os.path.join(root, "pool")], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "manifest: identical" in done.stdout and "added 0, removed 0" in done.stdout
  done = subprocess.run(cmd + ["ls", os.path.join(root, "missing")], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and "missing does not exist" in done.stderr, done.stderr
