"""The human review queue: preference items waiting for a person's A / B / tie / both-bad label.

SQLite, so the queue survives restarts and serves several reviewers at once. Every mutation
runs in one `BEGIN IMMEDIATE` transaction (one writer at a time, readers never see half of
it) on a connection of its own, so a ReviewQueue is safe to share between threads and two
processes may open the same file. WAL journal: a killed process loses at most its open
transaction, never the database.

Tables:
  items   one row per item (unique item_id; seq keeps insertion order, the order items are
          served in) with its current label and lease. A lease gives one reviewer an item for
          `lease_s` seconds so that two reviewers never get the same one; an expired lease
          may be taken by anyone.
  labels  the history: every label and every undo, never deleted, so `undo` knows what to
          revert and the audit can see relabels. An item's current label is its last
          label row not marked undone (`check` verifies this).
Reviewers see only prompt and responses, never the teacher's verdict (no anchoring).
"""

import contextlib
import json
import math
import os
import sqlite3
import threading
import time

from train.assets import file_ref, write_asset

LABELS = ("A", "B", "tie", "both_bad")
KINDS = ("review", "audit")
VERDICTS = ("A", "B", "tie")
BUCKETS = (0.0, 0.1, 0.2, 0.4, 1.0)  # confidence bucket edges: [0,.1) [.1,.2) [.2,.4) [.4,1]
_USER_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  item_id TEXT NOT NULL UNIQUE,
  prompt TEXT NOT NULL,
  response_a TEXT NOT NULL,
  response_b TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('review', 'audit')),
  teacher TEXT,
  meta TEXT,
  created REAL NOT NULL,
  label TEXT CHECK (label IS NULL OR label IN ('A', 'B', 'tie', 'both_bad')),
  reviewer TEXT,
  resolved_at REAL,
  lease_reviewer TEXT,
  lease_at REAL,
  lease_until REAL
);
CREATE INDEX IF NOT EXISTS items_open ON items (label, lease_until);
CREATE TABLE IF NOT EXISTS labels (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  item_id TEXT NOT NULL REFERENCES items (item_id),
  reviewer TEXT NOT NULL,
  action TEXT NOT NULL CHECK (action IN ('label', 'undo')),
  label TEXT NOT NULL,
  at REAL NOT NULL,
  undone INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS labels_reviewer ON labels (reviewer, action, undone);
"""
_PUBLIC = ("item_id", "prompt", "response_a", "response_b", "kind")


class AlreadyResolved(ValueError):
  """A label for an item that already has one."""


class UnknownItem(ValueError):
  """An item id the queue does not hold."""


class LeaseConflict(ValueError):
  """A label for an item another reviewer holds a live lease on."""


def _reviewer(reviewer) -> str:
  if not isinstance(reviewer, str) or not reviewer.strip() or len(reviewer) > 100:
    raise ValueError(f"reviewer must be a non-empty name of at most 100 characters, "
                     f"got {reviewer!r}")
  return reviewer.strip()


def _check_teacher(teacher) -> None:
  if teacher is None:
    return
  if not isinstance(teacher, dict):
    raise ValueError(f"teacher must be a dict or None, got {type(teacher).__name__}")
  if teacher.get("verdict") not in VERDICTS:
    raise ValueError(f"teacher verdict must be one of {VERDICTS}, got {teacher.get('verdict')!r}")
  conf = teacher.get("confidence")
  if not isinstance(conf, (int, float)) or not math.isfinite(conf) or not 0 <= conf <= 1:
    raise ValueError(f"teacher confidence must be a number in [0, 1], got {conf!r}")


def _bucket(conf: float, edges=BUCKETS) -> str:
  for lo, hi in zip(edges[:-1], edges[1:]):
    if lo <= conf < hi or (hi == edges[-1] and conf == hi):
      return f"[{lo:g},{hi:g}{']' if hi == edges[-1] else ')'}"
  return "out_of_range"


def _accuracy(correct: int, n: int) -> dict:
  """Accuracy with its 95% Wilson interval (sound at small n, unlike the normal one)."""
  if n == 0:
    return dict(n=0, correct=0, accuracy=None, ci95=None)
  z, p = 1.96, correct / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return dict(n=n, correct=correct, accuracy=round(p, 4),
              ci95=[round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)])


class ReviewQueue:
  """The queue in the SQLite file `path` (created with its schema if absent)."""

  def __init__(self, path: str, lease_s: float = 600.0):
    if not lease_s > 0:
      raise ValueError(f"lease_s must be positive, got {lease_s}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
      raise FileNotFoundError(f"review queue {path}: directory {parent} does not exist")
    self.path, self.lease_s = path, float(lease_s)
    # Threads of one process queue here for the write lock instead of in SQLite's busy
    # handler, whose sleeps let one tight writer starve the rest.
    self._write_lock = threading.Lock()
    try:
      with self._tx() as con:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, _USER_VERSION):
          raise ValueError(f"review queue {path}: schema version {version}, this meshlm reads "
                           f"{_USER_VERSION}")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 0 and tables - {"sqlite_sequence"}:
          raise ValueError(f"review queue {path}: an SQLite file with other tables "
                           f"({', '.join(sorted(tables))}), not a review queue")
        for statement in _SCHEMA.split(";"):
          if statement.strip():
            con.execute(statement)
        con.execute(f"PRAGMA user_version={_USER_VERSION}")
    except sqlite3.DatabaseError as e:
      raise ValueError(f"review queue {path}: not a usable SQLite database ({e})") from e

  @contextlib.contextmanager
  def _tx(self, write: bool = True):
    """One transaction on a fresh connection: IMMEDIATE takes the write lock up front (waiting
    up to 30 s for another writer), so a read-then-update never races another process."""
    with self._write_lock if write else contextlib.nullcontext():
      con = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
      con.row_factory = sqlite3.Row
      try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=FULL")  # a committed label survives power loss too
        con.execute("PRAGMA foreign_keys=ON")
        con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
          yield con
        except BaseException:
          if con.in_transaction:
            con.execute("ROLLBACK")
          raise
        if con.in_transaction:
          con.execute("COMMIT")
      finally:
        con.close()

  # --- Writing ---

  def add(self, item_id: str, prompt: str, response_a: str, response_b: str, *, kind: str,
          teacher: dict | None = None, meta: dict | None = None) -> bool:
    """Queues an item; False (and nothing changes) if `item_id` is already queued, so a
    resumed builder never duplicates items."""
    if not isinstance(item_id, str) or not item_id:
      raise ValueError(f"item_id must be a non-empty string, got {item_id!r}")
    for name, text in (("prompt", prompt), ("response_a", response_a),
                       ("response_b", response_b)):
      if not isinstance(text, str):
        raise ValueError(f"item {item_id}: {name} must be a string, got {type(text).__name__}")
    if kind not in KINDS:
      raise ValueError(f"item {item_id}: kind must be one of {KINDS}, got {kind!r}")
    _check_teacher(teacher)
    try:
      teacher_json = None if teacher is None else json.dumps(teacher, sort_keys=True)
      meta_json = None if meta is None else json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError) as e:
      raise ValueError(f"item {item_id}: teacher/meta must be JSON-serializable ({e})") from e
    with self._tx() as con:
      cur = con.execute(
          "INSERT OR IGNORE INTO items (item_id, prompt, response_a, response_b, kind, teacher, "
          "meta, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
          (item_id, prompt, response_a, response_b, kind, teacher_json, meta_json, time.time()))
      return cur.rowcount == 1

  def claim(self, reviewer: str) -> dict | None:
    """Leases the reviewer an item: the one they hold already (their most recently leased),
    else the first unresolved item nobody holds a live lease on; None when none is left."""
    reviewer = _reviewer(reviewer)
    with self._tx() as con:
      now = time.time()
      row = con.execute(
          "SELECT * FROM items WHERE label IS NULL AND lease_reviewer = ? "
          "ORDER BY lease_at DESC, seq LIMIT 1", (reviewer,)).fetchone()
      if row is None:
        row = con.execute(
            "SELECT * FROM items WHERE label IS NULL AND (lease_until IS NULL OR lease_until <= ?) "
            "ORDER BY seq LIMIT 1", (now,)).fetchone()
      if row is None:
        return None
      con.execute("UPDATE items SET lease_reviewer = ?, lease_at = ?, lease_until = ? "
                  "WHERE seq = ?", (reviewer, now, now + self.lease_s, row["seq"]))
      return {k: row[k] for k in _PUBLIC}

  def submit(self, item_id: str, reviewer: str, label: str) -> None:
    """Records `label` for the item. AlreadyResolved if it has a label; LeaseConflict if
    another reviewer holds a live lease on it; UnknownItem / ValueError for bad input."""
    reviewer = _reviewer(reviewer)
    if label not in LABELS:
      raise ValueError(f"label must be one of {LABELS}, got {label!r}")
    with self._tx() as con:
      row = con.execute("SELECT * FROM items WHERE item_id = ?", (item_id,)).fetchone()
      if row is None:
        raise UnknownItem(f"no item {item_id!r} in the review queue")
      if row["label"] is not None:
        raise AlreadyResolved(f"item {item_id} is already resolved ({row['label']!r} by "
                              f"{row['reviewer']}); the label {label!r} was not recorded")
      now = time.time()
      if (row["lease_reviewer"] not in (None, reviewer) and row["lease_until"] is not None
          and row["lease_until"] > now):
        raise LeaseConflict(f"item {item_id} is being reviewed by {row['lease_reviewer']}; "
                            f"the label {label!r} was not recorded")
      con.execute("UPDATE items SET label = ?, reviewer = ?, resolved_at = ?, "
                  "lease_reviewer = NULL, lease_at = NULL, lease_until = NULL WHERE seq = ?",
                  (label, reviewer, now, row["seq"]))
      con.execute("INSERT INTO labels (item_id, reviewer, action, label, at) "
                  "VALUES (?, ?, 'label', ?, ?)", (item_id, reviewer, label, now))

  def undo(self, reviewer: str) -> dict | None:
    """Reverts the reviewer's most recent label still in force; the item is leased back to
    them and returned (None if they have nothing to undo)."""
    reviewer = _reviewer(reviewer)
    with self._tx() as con:
      last = con.execute(
          "SELECT l.id, l.item_id, l.label FROM labels l JOIN items i ON i.item_id = l.item_id "
          "WHERE l.reviewer = ? AND l.action = 'label' AND l.undone = 0 "
          "AND i.reviewer = ? AND i.label IS NOT NULL ORDER BY l.id DESC LIMIT 1",
          (reviewer, reviewer)).fetchone()
      if last is None:
        return None
      now = time.time()
      con.execute("UPDATE labels SET undone = 1 WHERE id = ?", (last["id"],))
      con.execute("INSERT INTO labels (item_id, reviewer, action, label, at) "
                  "VALUES (?, ?, 'undo', ?, ?)", (last["item_id"], reviewer, last["label"], now))
      con.execute("UPDATE items SET label = NULL, reviewer = NULL, resolved_at = NULL, "
                  "lease_reviewer = ?, lease_at = ?, lease_until = ? WHERE item_id = ?",
                  (reviewer, now, now + self.lease_s, last["item_id"]))
      row = con.execute("SELECT * FROM items WHERE item_id = ?", (last["item_id"],)).fetchone()
      return {k: row[k] for k in _PUBLIC} | {"undone_label": last["label"]}

  # --- Reading ---

  def progress(self, reviewer: str | None = None) -> dict:
    with self._tx(write=False) as con:
      total, resolved, leased = con.execute(
          "SELECT COUNT(*), COUNT(label), "
          "SUM(label IS NULL AND lease_until IS NOT NULL AND lease_until > ?) FROM items",
          (time.time(),)).fetchone()
      mine = 0
      if reviewer is not None:
        mine = con.execute("SELECT COUNT(*) FROM items WHERE reviewer = ?",
                           (_reviewer(reviewer),)).fetchone()[0]
    return dict(total=total, resolved=resolved, pending=total - resolved, leased=leased or 0,
                mine=mine)

  def get(self, item_id: str) -> dict:
    """Everything about one item (teacher, meta, label, lease)."""
    with self._tx(write=False) as con:
      row = con.execute("SELECT * FROM items WHERE item_id = ?", (item_id,)).fetchone()
    if row is None:
      raise UnknownItem(f"no item {item_id!r} in the review queue")
    return _full(row)

  def history(self, item_id: str | None = None) -> list[dict]:
    """The label/undo history, oldest first."""
    with self._tx(write=False) as con:
      rows = (con.execute("SELECT * FROM labels ORDER BY id") if item_id is None else
              con.execute("SELECT * FROM labels WHERE item_id = ? ORDER BY id", (item_id,)))
      return [dict(r) for r in rows]

  def resolved(self) -> list[dict]:
    """Every resolved item, in queue order."""
    with self._tx(write=False) as con:
      rows = con.execute("SELECT * FROM items WHERE label IS NOT NULL ORDER BY seq").fetchall()
    return [{k: v for k, v in _full(r).items() if not k.startswith("lease_")} for r in rows]

  def check(self) -> list[str]:
    """Consistency problems (empty when sound): SQLite's integrity check, and every item's
    label equal to its last label row not undone."""
    with self._tx(write=False) as con:
      problems = [r[0] for r in con.execute("PRAGMA integrity_check") if r[0] != "ok"]
      rows = con.execute(
          "SELECT i.item_id, i.label, i.reviewer, "
          "(SELECT l.label || '|' || l.reviewer FROM labels l WHERE l.item_id = i.item_id "
          " AND l.action = 'label' AND l.undone = 0 ORDER BY l.id DESC LIMIT 1) AS last, "
          "(SELECT COUNT(*) FROM labels l WHERE l.item_id = i.item_id "
          " AND l.action = 'label' AND l.undone = 0) AS live FROM items i").fetchall()
    for r in rows:
      want = None if r["label"] is None else f"{r['label']}|{r['reviewer']}"
      if r["last"] != want or r["live"] != (0 if want is None else 1):
        problems.append(f"item {r['item_id']}: label {want} but history says {r['last']} "
                        f"({r['live']} live labels)")
    return problems

  def report(self, buckets=BUCKETS) -> dict:
    """Audit outcomes: the teacher's accuracy against the human labels, overall, by confidence
    bucket, by kind and by routing reason. Accuracy counts items where both the human and the
    teacher chose A or B; human ties / both-bad and teacher ties are counted apart."""
    items = self.resolved()
    report = dict(resolved=len(items), pending=self.progress()["pending"], by_kind={}, by_reason={},
                  human_labels={label: 0 for label in LABELS}, teacher_tie=0, no_teacher=0)
    groups = {"overall": [0, 0]}
    for item in items:
      report["human_labels"][item["label"]] += 1
      report["by_kind"][item["kind"]] = report["by_kind"].get(item["kind"], 0) + 1
      teacher = item["teacher"]
      if teacher is None:
        report["no_teacher"] += 1
        continue
      reason = str(teacher.get("reason", "unknown"))
      report["by_reason"][reason] = report["by_reason"].get(reason, 0) + 1
      if teacher["verdict"] == "tie":
        report["teacher_tie"] += 1
      if item["label"] not in ("A", "B") or teacher["verdict"] not in ("A", "B"):
        continue
      hit = int(item["label"] == teacher["verdict"])
      for key in ("overall", f"bucket {_bucket(teacher['confidence'], buckets)}",
                  f"kind {item['kind']}", f"reason {reason}"):
        groups.setdefault(key, [0, 0])
        groups[key][0] += hit
        groups[key][1] += 1
    report["teacher_accuracy"] = _accuracy(*groups.pop("overall"))
    report["accuracy_by_confidence"] = {
        _bucket(lo, buckets): _accuracy(*groups.get(f"bucket {_bucket(lo, buckets)}", (0, 0)))
        for lo in buckets[:-1]}
    for prefix in ("kind", "reason"):
      report[f"accuracy_by_{prefix}"] = {k[len(prefix) + 1:]: _accuracy(*v)
                                         for k, v in sorted(groups.items())
                                         if k.startswith(prefix + " ")}
    return report

  def export(self, root: str) -> str:
    """Writes the resolved items as the data asset ROOT/review_results/vK plus its report
    (report.json beside the data); returns the version directory."""
    con = sqlite3.connect(self.path, timeout=30.0)
    try:
      con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the WAL into the file: hash the content
    finally:
      con.close()
    rows, report = self.resolved(), self.report()
    lineage = dict(queue_db=file_ref(self.path), items=self.progress()["total"],
                   lease_s=self.lease_s, confidence_buckets=list(BUCKETS))
    version_dir = write_asset(root, "review_results", rows, kind="review_results",
                              lineage=lineage)
    tmp = os.path.join(version_dir, ".report.json.tmp")
    with open(tmp, "w") as f:
      json.dump(report, f, indent=2, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(version_dir, "report.json"))
    return version_dir


def _full(row) -> dict:
  item = dict(row)
  item.pop("seq")
  for key in ("teacher", "meta"):
    item[key] = None if item[key] is None else json.loads(item[key])
  return item
