"""The pair builder's journal, statistics and published asset (align/curate/pairs.py)."""

import hashlib
import json
import os

from align.curate.judge import RUBRIC
from train.assets import asset_ref, file_ref, sha256_file, write_asset
from train.workdir import is_workdir


def item_key(seed: int, text: str, k: int) -> int:
  """A stable 31-bit sampling seed for candidate k of a prompt."""
  digest = hashlib.sha256(f"{seed}:{k}:{text}".encode()).digest()
  return int.from_bytes(digest[:4], "big") >> 1


def read_journal(path: str, repair: bool = False) -> list[dict]:
  """Entries of WORKDIR/journal.jsonl, first per id. A torn last line (a run killed
  mid-write) is ignored; with `repair` (the builder, under its lock, before appending) it is
  cut off the file so its prompt is redone. A bad line elsewhere is corruption: refused."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  entries, seen, good = [], set(), 0
  lines = data.split(b"\n")
  for i, line in enumerate(lines):
    if line.strip():
      try:
        entry = json.loads(line)
      except json.JSONDecodeError:
        if i != len(lines) - 1:  # not the last, unterminated line
          raise ValueError(f"{path}: line {i + 1} is not JSON: the journal is corrupt") from None
        if repair:
          with open(path, "r+b") as f:
            f.truncate(good)
        return entries
      if not isinstance(entry, dict) or "id" not in entry:
        raise ValueError(f"{path}: line {i + 1} has no id: the journal is corrupt")
      if entry["id"] not in seen:
        seen.add(entry["id"])
        entries.append(entry)
    good += len(line) + 1
  if repair and data and not data.endswith(b"\n"):  # a whole last line, unterminated
    with open(path, "ab") as f:
      f.write(b"\n")
  return entries


def model_ref(path: str) -> dict:
  """Lineage of a model: a file's sha256, or for a directory (a workdir, an HF directory)
  the sha256 of its files' names and contents, with a workdir's newest checkpoint step."""
  if os.path.isfile(path):
    return file_ref(path)
  h, total = hashlib.sha256(), 0
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, path)
      if rel.startswith(("tensorboard", "metrics", ".")) or name.endswith(".log"):
        continue  # logs change as a run goes on; weights and configs don't
      h.update(rel.encode() + b"\0")
      with open(full, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          h.update(block)
          total += len(block)
  ref = {"path": os.path.abspath(path), "tree_sha256": h.hexdigest(), "bytes": total}
  try:
    if is_workdir(path):
      steps = [int(d) for d in os.listdir(os.path.join(path, "checkpoints")) if d.isdigit()]
      ref["checkpoint_step"] = max(steps) if steps else None
  except OSError:
    pass
  return ref


def write_stats(builder, journal: str, queue, wall_s: float) -> dict:
  """Counts from the journal (so a resumed run counts each prompt once) and the queue."""
  entries = read_journal(journal)
  routes, reasons, audits = {}, {}, {}
  for e in entries:
    routes[e["route"]] = routes.get(e["route"], 0) + 1
    if e["route"] in ("review", "skipped"):
      reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    for a in e.get("audit", []):
      audits[a] = audits.get(a, 0) + 1
  conf = [e["confidence"] for e in entries if "confidence" in e]
  agree = [e["judgement"]["agree"] for e in entries if "judgement" in e]
  stats = {
      "prompts_processed": len(entries),
      "emitted": routes.get("emit", 0),
      "routed_to_review": routes.get("review", 0),
      "skipped": routes.get("skipped", 0),
      "review_reasons": reasons,
      "audited": sum(1 for e in entries if e.get("audit")),
      "audit_reasons": audits,
      "mean_confidence": float(sum(conf) / len(conf)) if conf else None,
      "orders_agree": float(sum(agree) / len(agree)) if agree else None,
      "queue": queue.progress(),
      "calibration": builder.state.get("calibration"),
      "pool_read_report": builder.state.get("read_report"),
      "wall_s_this_run": round(wall_s, 1),
      "tokens_generated_this_run": getattr(builder, "tokens_generated", 0),
  }
  rm = [e["rm_margin"] for e in entries if "rm_margin" in e]
  if rm:
    stats["rm_agrees_with_teacher"] = float(sum(m > 0 for m in rm) / len(rm))
  tmp = os.path.join(builder.workdir, ".stats.json.tmp")
  with open(tmp, "w") as f:
    json.dump(stats, f, indent=1)
  os.replace(tmp, os.path.join(builder.workdir, "stats.json"))
  return stats


def _human_pair(item: dict) -> tuple[str, str] | None:
  if item["label"] == "A":
    return item["response_a"], item["response_b"]
  if item["label"] == "B":
    return item["response_b"], item["response_a"]
  return None  # tie or both bad: no preference to learn from


def publish(builder, journal: str, queue, stats: dict) -> str:
  """Writes the "pairs" asset: teacher pairs (an audited one follows the human's label where
  a human gave one), then pairs humans resolved from the review queue."""
  prefix = builder.state["run_id"] + "-"
  resolved = {r["item_id"][len(prefix):]: r for r in queue.resolved()
              if r["item_id"].startswith(prefix)}
  rows = []
  for e in read_journal(journal):
    human = resolved.get(e["id"])
    if e["route"] == "emit":
      row = {"id": e["id"], "prompt": e["prompt"], "chosen": e["chosen"],
             "rejected": e["rejected"], "source": "teacher", "confidence": e["confidence"]}
      if human is not None and human["kind"] == "audit":
        pair = _human_pair(human)
        if pair is None:
          continue  # the human found no preference: the teacher's is not kept
        if pair != (e["chosen"], e["rejected"]):
          row.update(chosen=pair[0], rejected=pair[1], source="human_audit")
      rows.append(row)
    elif e["route"] == "review" and human is not None:
      pair = _human_pair(human)
      if pair is not None:
        rows.append({"id": e["id"], "prompt": e["prompt"], "chosen": pair[0],
                     "rejected": pair[1], "source": "human", "confidence": None})
  cfg = builder.cfg
  rubric = cfg.teacher.rubric or RUBRIC
  lineage = dict(
      pool=asset_ref(builder.state["pool_asset"]),
      eval_prompts=asset_ref(builder.state["eval_asset"]),
      pool_source=file_ref(cfg.pool.path), models=builder.state["models"],
      run_id=builder.state["run_id"],
      student_rm=cfg.route.student_rm or None, teacher_mode=cfg.teacher.mode,
      rubric=rubric, rubric_sha256=hashlib.sha256(rubric.encode()).hexdigest(),
      thresholds=dict(confidence=cfg.route.confidence, audit_fraction=cfg.route.audit_fraction,
                      min_mass=cfg.teacher.min_mass),
      seeds=dict(seed=cfg.seed),
      sampling=dict(n=cfg.student.n, temperature=cfg.student.temperature,
                    top_p=cfg.student.top_p, max_tokens=cfg.student.max_tokens),
      calibration=builder.state.get("calibration"),
      queue_db=os.path.abspath(builder.db_path),
      journal_sha256=sha256_file(journal) if os.path.exists(journal) else None,
      stats={k: v for k, v in stats.items() if k != "asset"},
      config=json.loads(cfg.to_json()))
  return write_asset(builder.assets_root, "pairs", rows, kind="pairs", lineage=lineage)
