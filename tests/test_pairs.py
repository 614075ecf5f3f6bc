"""`meshlm pairs` end to end on real hh-rlhf prompts with SmolLM2-135M-Instruct as student
and teacher: routing, the review queue, the manifest's lineage, a killed run resumed."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import deps
from train.assets import read_asset, read_manifest
from align.curate.pairs_publish import read_journal
from align.curate.pool import prompt_id, read_pool, split_prompts
from align.curate.review_db import ReviewQueue
from test_align_rl import rm_workdir  # noqa: F401  (a fixture: a tiny `meshlm rm` workdir)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "experiments", "pairs_hh.py")
HH = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test.jsonl.gz")
FAST = ["--config.student.max_tokens=24", "--config.teacher.response_tokens=48",
        "--config.teacher.max_len=384"]


def meshlm(*args, **kw):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def qid(workdir: str, pid: str) -> str:
  """A journal entry's review-queue item id (namespaced by the run)."""
  with open(os.path.join(workdir, "state.json")) as f:
    return json.load(f)["run_id"] + "-" + pid


def run(*args) -> tuple[int, str]:
  p = meshlm(*args)
  out, _ = p.communicate(timeout=900)
  return p.returncode, out


@pytest.fixture(scope="module", autouse=True)
def needs_model():
  deps.smollm()


@pytest.fixture(scope="module")
def built(tmp_path_factory, rm_workdir):
  """One real run: 10 prompts, calibration on 8 labelled pairs, 50% audited, the student's
  reward model consulted (a tiny two-step one: test_align_rl.rm_workdir)."""
  student_rm = rm_workdir
  workdir = str(tmp_path_factory.mktemp("pairs") / "run")
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={workdir}", "--config.pool.limit=10",
                "--config.teacher.calib_pairs=8", "--config.route.audit_fraction=0.5",
                f"--config.route.student_rm={student_rm}", *FAST)
  assert rc == 0, out
  stats = json.loads(out[out.index("{\n"):])
  return workdir, stats, student_rm


def test_pairs_end_to_end_statistics_queue_and_lineage(built):
  workdir, stats, _ = built
  entries = read_journal(os.path.join(workdir, "journal.jsonl"))
  assert stats["prompts_processed"] == len(entries) == 10
  assert stats["emitted"] + stats["routed_to_review"] + stats["skipped"] == 10
  threshold = 0.3
  for e in entries:  # the routing rule holds item by item
    if e["route"] == "review" and e["reason"] == "low_confidence":
      assert e["confidence"] < threshold
    if e["route"] == "emit":
      assert e["confidence"] >= threshold and e["chosen"] == e["candidates"][e["best"]]
      # the student's reward model was asked; where it disagrees, the item is audited
      assert ("rm_disagreement" in e["audit"]) == (e["rm_margin"] <= 0)
  # every low-confidence and audited item really is in the queue, once
  queue = ReviewQueue(os.path.join(workdir, "review.sqlite"))
  queued = {e["id"]: e for e in entries if e["route"] == "review" or e.get("audit")}
  assert queue.progress()["total"] == len(queued) == stats["routed_to_review"] + stats["audited"]
  for pid, e in queued.items():
    item = queue.get(qid(workdir, pid))
    assert item["kind"] == ("review" if e["route"] == "review" else "audit")
    assert {item["response_a"], item["response_b"]} <= set(e["candidates"])
    if e["route"] == "review":
      assert item["teacher"]["confidence"] < threshold
  # the versioned dataset and its lineage
  asset = stats["asset"]
  rows, manifest = read_asset(asset), read_manifest(asset)
  assert manifest["kind"] == "pairs" and manifest["rows"] == len(rows) == stats["emitted"]
  lineage = manifest["lineage"]
  for key in ("pool", "eval_prompts", "pool_source", "models", "rubric", "rubric_sha256",
              "thresholds", "seeds", "sampling", "calibration", "queue_db", "config"):
    assert lineage[key] not in (None, {}, ""), key
  assert len(lineage["models"]["teacher"]["sha256"]) == 64
  assert len(lineage["models"]["student_rm"]["tree_sha256"]) == 64
  assert lineage["calibration"]["fitted"] and lineage["calibration"]["pairs"] == 8
  assert lineage["thresholds"] == {"confidence": 0.3, "audit_fraction": 0.5, "min_mass": 0.05}
  # the held-out evaluation prompts never enter the pool
  pool = {r["prompt"] for r in read_asset(lineage["pool"]["path"])}
  held_out = {r["prompt"] for r in read_asset(lineage["eval_prompts"]["path"])}
  assert held_out and not pool & held_out
  assert all(e["prompt"] in pool for e in entries)


def test_human_labels_flow_back_into_a_new_version(built):
  workdir, stats, student_rm = built
  queue = ReviewQueue(os.path.join(workdir, "review.sqlite"))
  labelled = 0
  while (item := queue.claim("ann")) is not None:
    queue.submit(item["item_id"], "ann", "A")
    labelled += 1
  assert labelled == queue.progress()["total"] > 0
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={workdir}", "--config.pool.limit=10",
                "--config.teacher.calib_pairs=8", "--config.route.audit_fraction=0.5",
                f"--config.route.student_rm={student_rm}", *FAST, "--publish_only")
  assert rc == 0, out
  v2 = json.loads(out[out.index("{\n"):])["asset"]
  assert v2.endswith("v2")
  rows = read_asset(v2)
  human = [r for r in rows if r["source"] == "human"]
  assert len(human) == stats["routed_to_review"]  # every review item was labelled "A"
  assert len(rows) == stats["emitted"] + stats["routed_to_review"]
  assert read_manifest(v2)["lineage"]["models"] == read_manifest(
      os.path.join(os.path.dirname(v2), "v1"))["lineage"]["models"]
  for r in rows:  # where a human labelled, the human's choice is the chosen response
    if r["source"] != "teacher":
      item = queue.get(qid(workdir, r["id"]))
      assert r["chosen"] == item["response_a"] and r["rejected"] == item["response_b"]
  report = queue.report()
  assert report["resolved"] == labelled and report["human_labels"]["A"] == labelled
  judged = labelled - stats["review_reasons"].get("unparsable_verdict", 0)
  assert report["teacher_accuracy"]["n"] == judged
  rc, out = run("data", "diff", os.path.join(os.path.dirname(v2), "v1"), v2)
  assert rc == 0, out


def test_killed_run_resumes_without_duplicates(tmp_path):
  workdir = str(tmp_path / "run")
  args = ["pairs", f"--config={CONFIG}", f"--workdir={workdir}", "--config.pool.limit=12",
          "--config.teacher.temperature=0.2", "--config.route.confidence=0.5",
          "--config.route.audit_fraction=0.25", *FAST]
  journal = os.path.join(workdir, "journal.jsonl")
  p = meshlm(*args)
  deadline = time.time() + 600
  while time.time() < deadline and p.poll() is None:
    if os.path.exists(journal) and len(read_journal(journal)) >= 4:
      break
    time.sleep(0.2)
  assert p.poll() is None, p.communicate()[0]
  p.send_signal(signal.SIGKILL)  # a real kill, mid-run
  p.wait()
  done_before = len(read_journal(journal))
  assert 4 <= done_before < 12
  rc, out = run(*args)
  assert rc == 0, out
  assert f"{12 - done_before}/{12 - done_before} prompts" in out  # only the rest was redone
  entries = read_journal(journal)
  ids = [e["id"] for e in entries]
  assert len(ids) == len(set(ids)) == 12
  queue = ReviewQueue(os.path.join(workdir, "review.sqlite"))
  assert queue.progress()["total"] == sum(1 for e in entries
                                          if e["route"] == "review" or e.get("audit"))
  for e in entries:  # each queued item is the journal's: same responses, same kind
    if e["route"] == "review" or e.get("audit"):
      item = queue.get(qid(workdir, e["id"]))
      assert item["kind"] == ("review" if e["route"] == "review" else "audit")
      assert {item["response_a"], item["response_b"]} <= set(e["candidates"])
  # Two kills the SIGKILL above may not have hit, made by hand, repaired by one resume:
  # (1) after a journal line but before its queue insert: the resumed run queues the item;
  # (2) mid-write of the last journal line (so before its queue insert): the torn line is
  # cut and its prompt redone.
  queued = [e for e in entries[:-1] if e["route"] == "review" or e.get("audit")]
  assert queued, "no item was queued: raise route.confidence"
  import sqlite3
  con = sqlite3.connect(os.path.join(workdir, "review.sqlite"))
  with con:
    for pid in (queued[-1]["id"], ids[-1]):
      con.execute("DELETE FROM items WHERE item_id = ?", (qid(workdir, pid),))
  con.close()
  with open(journal) as f:
    lines = f.readlines()
  with open(journal, "w") as f:
    f.writelines(lines[:-1] + [lines[-1][:40]])
  rc, out = run(*args)
  assert rc == 0, out
  assert "1/1 prompts" in out
  entries = read_journal(journal)
  assert [e["id"] for e in entries] == ids
  assert queue.progress()["total"] == sum(1 for e in entries
                                          if e["route"] == "review" or e.get("audit"))
  assert queue.get(qid(workdir, queued[-1]["id"]))["prompt"] == queued[-1]["prompt"]
  last = entries[-1]
  if last["route"] == "review" or last.get("audit"):
    item = queue.get(qid(workdir, last["id"]))
    assert {item["response_a"], item["response_b"]} <= set(last["candidates"])
  assert queue.check() == []
  # a different config in the same workdir is refused
  rc, out = run(*[a for a in args if "audit_fraction" not in a],
                "--config.route.audit_fraction=0.9")
  assert rc != 0 and "different config" in out and "route.audit_fraction" in out


def test_torn_journal_line_is_cut(tmp_path):
  path = tmp_path / "journal.jsonl"
  torn = '{"id": "a", "route": "emit"}\n{"id": "b", "rou'
  path.write_text(torn)
  assert [e["id"] for e in read_journal(str(path))] == ["a"]
  assert path.read_text() == torn  # a reader never writes
  assert [e["id"] for e in read_journal(str(path), repair=True)] == ["a"]
  assert path.read_text() == '{"id": "a", "route": "emit"}\n'
  path.write_text('{"id": "a"}\nnot json\n{"id": "c"}\n')
  with pytest.raises(ValueError, match="line 2 .*corrupt"):
    read_journal(str(path))


def test_malformed_prompt_pools(tmp_path):
  ok = tmp_path / "ok.jsonl"
  rows = [json.dumps({"prompt": f"question {i}?"}) for i in range(8)]
  rows += ["{not json", json.dumps({"prompt": ""}), json.dumps({"text": "x"}),
           json.dumps(["a list"]), json.dumps({"prompt": "question 0?"})]
  ok.write_text("\n".join(rows) + "\n")
  prompts, report = read_pool(str(ok), "jsonl")
  assert len(prompts) == 8
  assert report["skipped"] == {"bad_json": 1, "empty": 1, "missing_fields": 1,
                               "not_an_object": 1, "duplicate": 1}
  assert report["first_bad"]["bad_json"] == 9
  bad = tmp_path / "bad.jsonl"
  bad.write_text("\n".join(["{oops"] * 6 + [json.dumps({"prompt": "fine?"})]) + "\n")
  with pytest.raises(ValueError, match=r"6 of 7 rows are malformed.*'bad_json': 1"):
    read_pool(str(bad), "jsonl")
  with pytest.raises(ValueError, match="format"):
    read_pool(str(ok), "csv")
  with pytest.raises(FileNotFoundError):
    read_pool(str(tmp_path / "missing.jsonl"), "jsonl")
  # the real hh-rlhf file: repeated openings are the only skips
  prompts, report = read_pool(HH, "hh")
  with gzip.open(HH, "rt") as f:
    assert report["rows"] == sum(1 for line in f if line.strip())
  assert set(report["skipped"]) == {"duplicate"}
  split = split_prompts(prompts, eval_fraction=0.1, calib_fraction=0.05)
  assert sum(map(len, split.values())) == len(prompts)
  assert 0.07 < len(split["eval"]) / len(prompts) < 0.13
  assert split == split_prompts(prompts, eval_fraction=0.1, calib_fraction=0.05)
  assert len({prompt_id(p) for p in prompts}) == len(prompts)


def test_cli_rejects_a_malformed_pool_clearly(tmp_path):
  bad = tmp_path / "pool.jsonl"
  bad.write_text("{broken\n" * 5)
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={tmp_path / 'w'}",
                f"--config.pool.path={bad}", "--config.pool.format=jsonl")
  assert rc != 0 and "malformed" in out and "first bad line" in out
  assert not os.path.exists(tmp_path / "w" / "assets")  # nothing half-written


def test_a_teacher_that_does_not_answer(tmp_path):
  """Unparsable verdicts: with a fixed temperature every item is routed to review and
  counted; asked to calibrate, the run stops with a clear error."""
  workdir = str(tmp_path / "run")
  derail = "--config.teacher.prefill=The capital of France is Paris. The population of Paris is about"
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={workdir}", "--config.pool.limit=4",
                "--config.teacher.temperature=1.0", derail, *FAST)
  assert rc == 0, out
  stats = json.loads(out[out.index("{\n"):])
  assert stats["routed_to_review"] == 4 and stats["emitted"] == 0
  assert stats["review_reasons"] == {"unparsable_verdict": 4}
  assert ReviewQueue(os.path.join(workdir, "review.sqlite")).progress()["total"] == 4
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={tmp_path / 'calib'}",
                "--config.pool.limit=4", "--config.teacher.calib_pairs=8", derail, *FAST)
  assert rc != 0 and "unparsable verdicts" in out and "teacher.prefill" in out


def test_publish_only_needs_a_run(tmp_path):
  rc, out = run("pairs", f"--config={CONFIG}", f"--workdir={tmp_path / 'w'}", "--publish_only")
  assert rc != 0 and "nothing to publish" in out


def test_a_resumed_run_may_only_change_the_limit(tmp_path):
  from align.curate.pairs import Builder
  from experiments.pairs_hh import get_config
  workdir = str(tmp_path / "w")
  cfg = get_config()
  cfg.pool.limit = 4
  prompts = Builder(cfg, workdir)._pool_assets()
  assert len(prompts) == 4
  cfg.pool.limit = 6
  assert len(Builder(cfg, workdir)._pool_assets()) == 6  # goes on to more of the same pool
  cfg.route.confidence = 0.9
  with pytest.raises(ValueError, match=r"differs in \['route.confidence'\]"):
    Builder(cfg, workdir)
