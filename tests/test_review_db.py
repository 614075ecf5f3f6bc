"""The review queue (align/curate/review_db.py): idempotent adds, leases, refused relabels, undo, the
audit report, export as an asset, and consistency under concurrent and killed processes."""

import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from train.assets import read_asset, read_manifest, sha256_file
from align.curate.review_db import AlreadyResolved, LeaseConflict, ReviewQueue, UnknownItem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test.jsonl.gz")


def hh_items(n: int) -> list[dict]:
  """n review items from real hh-rlhf rows: the conversation up to the last assistant turn,
  and the chosen / rejected replies as A / B (swapped every other row)."""
  items = []
  with gzip.open(HH, "rt") as f:
    for i, line in zip(range(n), f):
      row = json.loads(line)
      cut = row["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")
      chosen, rejected = row["chosen"][cut:].strip(), row["rejected"][cut:].strip()
      a, b = (chosen, rejected) if i % 2 == 0 else (rejected, chosen)
      items.append(dict(item_id=f"hh-{i:04d}", prompt=row["chosen"][:cut].strip(),
                        response_a=a, response_b=b,
                        kind="audit" if i % 5 == 4 else "review",
                        teacher=dict(verdict="A" if i % 3 else "B", confidence=(i % 10) / 10,
                                     reason="random_audit" if i % 5 == 4 else "low_confidence"),
                        meta=dict(source="hh-rlhf helpful-base test", row=i)))
  return items


def fill(queue: ReviewQueue, items) -> None:
  for item in items:
    item = dict(item)
    assert queue.add(item.pop("item_id"), item.pop("prompt"), item.pop("response_a"),
                     item.pop("response_b"), **item)


def snapshot(path: str):
  """Every row of both tables: equal snapshots = an unchanged database."""
  con = sqlite3.connect(path)
  try:
    return (con.execute("SELECT * FROM items ORDER BY seq").fetchall(),
            con.execute("SELECT * FROM labels ORDER BY id").fetchall())
  finally:
    con.close()


@pytest.fixture
def queue(tmp_path):
  q = ReviewQueue(str(tmp_path / "queue.sqlite"))
  fill(q, hh_items(10))
  return q


def test_add_is_idempotent_and_validates(queue):
  first = queue.get("hh-0000")
  assert not queue.add("hh-0000", "other prompt", "x", "y", kind="audit")  # a resumed builder
  assert queue.get("hh-0000") == first
  assert queue.progress() == dict(total=10, resolved=0, pending=10, leased=0, mine=0)
  assert first["teacher"]["reason"] == "low_confidence" and first["meta"]["row"] == 0
  bad = [(dict(kind="gold"), "kind must be one of"),
         (dict(kind="review", teacher={"verdict": "C", "confidence": .5}), "teacher verdict"),
         (dict(kind="review", teacher={"verdict": "A", "confidence": 1.5}), "confidence"),
         (dict(kind="review", teacher={"verdict": "A", "confidence": float("nan")}), "confidence"),
         (dict(kind="review", meta={"x": object()}), "JSON-serializable")]
  for kwargs, message in bad:
    with pytest.raises(ValueError, match=message):
      queue.add("new", "p", "a", "b", **kwargs)
  with pytest.raises(ValueError, match="response_b must be a string"):
    queue.add("new", "p", "a", None, kind="review")
  with pytest.raises(ValueError, match="item_id"):
    queue.add("", "p", "a", "b", kind="review")
  assert queue.progress()["total"] == 10


def test_claims_are_leased_and_expire(tmp_path):
  q = ReviewQueue(str(tmp_path / "q.sqlite"), lease_s=0.5)
  fill(q, hh_items(3))
  assert q.claim("alice")["item_id"] == "hh-0000"
  assert q.claim("alice")["item_id"] == "hh-0000"  # the same reviewer gets their item back
  assert q.claim("bob")["item_id"] == "hh-0001"
  with pytest.raises(LeaseConflict, match="being reviewed by alice"):
    q.submit("hh-0000", "bob", "A")
  assert q.progress("bob") == dict(total=3, resolved=0, pending=3, leased=2, mine=0)
  time.sleep(0.6)  # both leases expire: alice's item may go to carol
  assert q.claim("carol")["item_id"] == "hh-0000"
  q.submit("hh-0000", "carol", "tie")
  with pytest.raises(AlreadyResolved):  # alice comes back too late
    q.submit("hh-0000", "alice", "A")
  assert q.claim("alice")["item_id"] == "hh-0001"  # bob's expired lease
  assert q.claim("bob")["item_id"] == "hh-0002"
  assert q.claim("dave") is None
  with pytest.raises(ValueError, match="reviewer"):
    q.claim("  ")


def test_refused_submits_change_nothing(queue):
  item = queue.claim("alice")["item_id"]
  queue.submit(item, "alice", "A")
  before = snapshot(queue.path)
  with pytest.raises(AlreadyResolved, match=f"item {item} is already resolved .'A' by alice."):
    queue.submit(item, "bob", "B")
  with pytest.raises(AlreadyResolved):
    queue.submit(item, "alice", "A")
  with pytest.raises(UnknownItem, match="no item 'nope'"):
    queue.submit("nope", "alice", "A")
  with pytest.raises(ValueError, match="label must be one of"):
    queue.submit("hh-0001", "alice", "a")
  assert snapshot(queue.path) == before
  assert queue.check() == []


def test_undo_reverts_own_labels_in_order(queue):
  labels = {}
  for label in ("A", "B", "both_bad"):
    item = queue.claim("alice")["item_id"]
    queue.submit(item, "alice", label)
    labels[item] = label
  queue.submit(queue.claim("bob")["item_id"], "bob", "tie")
  held = queue.claim("alice")["item_id"]  # alice's 4th item, leased
  undone = queue.undo("alice")
  assert (undone["item_id"], undone["undone_label"]) == ("hh-0002", "both_bad")
  assert queue.claim("alice")["item_id"] == "hh-0002"  # the undone item is hers again
  assert queue.get("hh-0002")["label"] is None
  assert queue.progress("alice") == dict(total=10, resolved=3, pending=7, leased=2, mine=2)
  assert queue.undo("alice")["item_id"] == "hh-0001"  # undo twice: the label before
  assert queue.progress("bob")["mine"] == 1  # bob's label is not alice's to undo
  queue.submit("hh-0001", "alice", "A")  # relabel after undo
  queue.submit("hh-0002", "alice", "tie")
  assert queue.claim("alice")["item_id"] == held
  assert [(r["action"], r["label"], r["undone"]) for r in queue.history("hh-0001")] == [
      ("label", "B", 1), ("undo", "B", 0), ("label", "A", 0)]
  assert {r["item_id"]: r["label"] for r in queue.resolved()} == {
      "hh-0000": "A", "hh-0001": "A", "hh-0002": "tie", "hh-0003": "tie"}
  assert queue.undo("carol") is None
  assert queue.check() == []


def test_report_accuracy_by_confidence_bucket(tmp_path):
  q = ReviewQueue(str(tmp_path / "q.sqlite"))
  # (teacher verdict, confidence, reason, human label)
  cases = [("A", .05, "low_confidence", "A"), ("A", .05, "low_confidence", "B"),
           ("B", .15, "low_confidence", "B"), ("A", .3, "rm_disagreement", "B"),
           ("A", .9, "random_audit", "A"), ("B", 1.0, "random_audit", "B"),
           ("tie", .02, "low_confidence", "A"), ("A", .5, "random_audit", "both_bad"),
           ("B", .6, "random_audit", "tie")]
  for i, (verdict, conf, reason, _) in enumerate(cases):
    kind = "audit" if reason == "random_audit" else "review"
    q.add(f"i{i}", "p", "a", "b", kind=kind,
          teacher=dict(verdict=verdict, confidence=conf, reason=reason))
  q.add("plain", "p", "a", "b", kind="review")
  for i, (*_, human) in enumerate(cases):
    q.submit(f"i{i}", "alice", human)
  q.submit("plain", "alice", "A")
  r = q.report()
  assert r["resolved"] == 10 and r["pending"] == 0
  assert r["no_teacher"] == 1 and r["teacher_tie"] == 1
  assert r["human_labels"] == {"A": 4, "B": 4, "tie": 1, "both_bad": 1}
  assert r["by_kind"] == {"audit": 4, "review": 6}
  assert r["by_reason"] == {"low_confidence": 4, "rm_disagreement": 1, "random_audit": 4}
  overall = r["teacher_accuracy"]
  assert (overall["n"], overall["correct"], overall["accuracy"]) == (6, 4, round(4 / 6, 4))
  assert overall["ci95"][0] < 4 / 6 < overall["ci95"][1]
  by_bucket = {k: (v["n"], v["correct"]) for k, v in r["accuracy_by_confidence"].items()}
  assert by_bucket == {"[0,0.1)": (2, 1), "[0.1,0.2)": (1, 1), "[0.2,0.4)": (1, 0),
                       "[0.4,1]": (2, 2)}
  assert r["accuracy_by_kind"]["audit"]["accuracy"] == 1.0
  assert r["accuracy_by_reason"]["rm_disagreement"] == dict(n=1, correct=0, accuracy=0.0,
                                                          ci95=[0.0, 0.7935])


def test_export_writes_a_versioned_asset(queue, tmp_path):
  for label in ("A", "tie", "B"):
    queue.submit(queue.claim("alice")["item_id"], "alice", label)
  root = str(tmp_path / "assets")
  v1 = queue.export(root)
  assert v1.endswith(os.path.join("review_results", "v1"))
  rows = read_asset(v1)
  assert rows == json.loads(json.dumps(queue.resolved()))
  assert [r["label"] for r in rows] == ["A", "tie", "B"] and rows[0]["teacher"]["verdict"]
  manifest = read_manifest(v1)
  assert manifest["kind"] == "review_results" and manifest["rows"] == 3
  ref = manifest["lineage"]["queue_db"]
  assert ref["sha256"] == sha256_file(queue.path)  # the WAL was folded in before hashing
  with open(os.path.join(v1, "report.json")) as f:
    assert json.load(f) == json.loads(json.dumps(queue.report()))
  queue.submit(queue.claim("bob")["item_id"], "bob", "both_bad")
  assert len(read_asset(queue.export(root))) == 4  # the next export is v2
  assert read_manifest(os.path.join(root, "review_results"))["version"] == 2


def test_not_a_queue_is_refused(tmp_path):
  garbage = tmp_path / "garbage.sqlite"
  garbage.write_text("not a database at all " * 100)
  with pytest.raises(ValueError, match="not a usable SQLite database"):
    ReviewQueue(str(garbage))
  other = tmp_path / "other.sqlite"
  con = sqlite3.connect(other)
  con.execute("CREATE TABLE t (x)")
  con.commit()
  con.close()
  with pytest.raises(ValueError, match="not a review queue"):
    ReviewQueue(str(other))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ReviewQueue(str(tmp_path / "missing" / "q.sqlite"))


WORKER = """
import json, os, sys, time
from align.curate.review_db import ReviewQueue
q, seen = ReviewQueue(sys.argv[1]), []
open(sys.argv[1] + ".ready-" + sys.argv[2], "w").close()
while not os.path.exists(sys.argv[1] + ".go"):  # start together
  time.sleep(0.01)
while (item := q.claim(sys.argv[2])) is not None:
  seen.append(item["item_id"])
  q.submit(item["item_id"], sys.argv[2], "AB"[len(seen) % 2])
  time.sleep(0.005)  # think time, outside any transaction (a tight loop would starve the others)
print(json.dumps(seen))
"""


def test_concurrent_processes_never_share_items(tmp_path):
  path = str(tmp_path / "q.sqlite")
  q = ReviewQueue(path)
  for i in range(90):
    q.add(f"item-{i}", f"prompt {i}", "a", "b", kind="review")
  workers = [subprocess.Popen([sys.executable, "-c", WORKER, path, f"reviewer-{k}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(3)]
  deadline = time.time() + 30
  while sum(os.path.exists(f"{path}.ready-reviewer-{k}") for k in range(3)) < 3:
    assert time.time() < deadline and all(w.poll() is None for w in workers), "workers died"
    time.sleep(0.01)
  open(path + ".go", "w").close()
  seen = {}
  for k, w in enumerate(workers):
    out, err = w.communicate(timeout=60)
    assert w.returncode == 0, err
    seen[f"reviewer-{k}"] = json.loads(out)
  claimed = [i for ids in seen.values() for i in ids]
  assert len(claimed) == len(set(claimed)) == 90  # every item to exactly one reviewer
  assert all(len(ids) > 0 for ids in seen.values()), {k: len(v) for k, v in seen.items()}
  by_item = {r["item_id"]: r["reviewer"] for r in q.resolved()}
  assert all(by_item[i] == who for who, ids in seen.items() for i in ids)
  assert q.check() == []


KILLED = """
import itertools, sys, time
from align.curate.review_db import ReviewQueue
q = ReviewQueue(sys.argv[1])
for n in itertools.count():
  while (item := q.claim("alice")) is None:  # drained before the kill: wait for it
    time.sleep(1)
  q.submit(item["item_id"], "alice", "A")
  if n % 3 == 2:
    q.undo("alice")
  print(n, flush=True)
"""


def test_sigkilled_writer_leaves_the_queue_consistent(tmp_path):
  path = str(tmp_path / "q.sqlite")
  q = ReviewQueue(path)
  for i in range(60):
    q.add(f"item-{i}", f"prompt {i}", "a", "b", kind="review")
  w = subprocess.Popen([sys.executable, "-c", KILLED, path], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  for _ in range(20):  # let it get going, then kill it mid-transaction (most likely)
    assert w.stdout.readline(), w.stderr.read()
  os.kill(w.pid, signal.SIGKILL)
  w.wait()
  assert q.check() == []
  p = q.progress("alice")
  assert 20 - 7 <= p["resolved"] == p["mine"] and p["total"] == 60
  assert not q.add("item-0", "again", "a", "b", kind="review")  # a restart adds nothing twice
  item = q.claim("alice")  # and she carries on with the item she held
  q.submit(item["item_id"], "alice", "B")
  assert q.progress()["resolved"] == p["resolved"] + 1 and q.check() == []
