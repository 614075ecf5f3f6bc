"""Decontamination: n-gram overlap between training rows and protected evaluation sets.

GPT-3 style (Brown et al. 2020, appendix C): text is lowercased, punctuation is deleted
("what's" -> "whats"), and the rest is split on whitespace; a training row overlaps an
evaluation row when they share an n-gram of n tokens (default 13).

Short evaluation rows: an evaluation text of fewer than n tokens has no n-gram. GPT-3 used
N between 8 and 13 depending on the dataset; here the whole normalized text of such a row is
its one n-gram: a training row matches it when it contains those tokens contiguously. Texts
of fewer than `min_tokens` tokens (default 8, GPT-3's smallest N) are not indexed: a 2-word
row like "Nothing happens" occurs in ordinary text and would refuse clean data. The index
counts them (`EvalIndex.skipped_short`; of the default sets: 90 AlpacaEval, 8 MT-Bench,
475 TruthfulQA question/answer and 175 XSTest texts).

Evaluation sets are registered in data/protected_evals.json (train/eval_registry.py).
`eval_sets` selects them: "default" (every registered entry), names and asset directories
(a list, or one comma-separated string; "default" may be among them), or empty (no check).

The training-run hook (`check_records` for align/datasets.py, `check_documents` for
train/data.py; config data.decontam, DEFAULTS when absent) refuses a training split when
more than data.decontam.max_overlap_rows (a fraction; 0: any row) of its rows overlap,
naming the first 10; data.decontam.allow=True trains anyway with a warning. There are no
waivers: a training file that overlaps is fixed at its root by `write_decontaminated`
(`meshlm data decontam`), which writes its clean rows as a data asset whose manifest counts
what was dropped; the evaluation sets stay whole.

The index holds Python hashes of token tuples in dicts: fast, per process (the hash is
salted per process), so it is cached per process and never stored.
"""

import dataclasses
import hashlib
import os
import re
import sys
from typing import Any, Mapping, Sequence

from train import assets
from train.eval_registry import (REGISTRY, strings, abspath, jsonl_lines, load_registry,
                                 read_rows, register_asset, row_texts)

__all__ = ["normalize", "build_index", "check_rows", "enforce", "check_records",
           "check_documents", "write_decontaminated", "load_registry", "register_asset",
           "REGISTRY", "DEFAULTS"]
DEFAULTS = {"n": 13, "min_tokens": 8, "max_overlap_rows": 0.0, "allow": False,
            "eval_sets": "default"}
_PUNCT = re.compile(r"[^\w\s]")
_CACHE: dict = {}  # (entries, n, min_tokens, file stamps) -> EvalIndex


def normalize(text: str) -> list[str]:
  """Lowercase, delete punctuation, split on whitespace."""
  return _PUNCT.sub("", text.lower()).split()


def _grams(tokens: Sequence[str], n: int):
  """The n-token tuples of `tokens`, in order (C-speed zip of shifted views)."""
  return zip(*(tokens[k:] for k in range(n)))


# --- The index ---


@dataclasses.dataclass
class EvalIndex:
  """Hashed n-grams of the selected evaluation sets. `grams[L]` maps the hash of an L-token
  tuple to (set name, eval row, eval text); L = n, plus the lengths of whole short rows."""
  n: int
  min_tokens: int
  sets: list[str]
  grams: dict[int, dict[int, tuple]]
  rows: dict[str, int]            # eval rows read per set
  skipped_short: dict[str, int]   # texts under min_tokens tokens, not indexed

  @property
  def size(self) -> int:
    return sum(len(g) for g in self.grams.values())


def _select(eval_sets, registry: str) -> list[dict]:
  """Registry entries for `eval_sets` ("default", a comma-separated string or a list of
  registry names and asset paths)."""
  if isinstance(eval_sets, str):
    eval_sets = [s.strip() for s in eval_sets.split(",")]
  wanted = [s for s in (eval_sets or ()) if s]
  if not wanted:
    return []
  registered = load_registry(registry) if registry else []
  by_name = {e["name"]: e for e in registered}
  out = []
  for item in wanted:
    if item == "default":
      out.extend(registered)
    elif item in by_name:
      out.append(by_name[item])
    elif os.path.isdir(abspath(item)):
      out.append({"name": item, "asset": item})
    else:
      raise ValueError(f"eval set {item!r}: not a name in {registry} "
                       f"({sorted(by_name)}) nor an asset directory")
  seen, unique = set(), []
  for e in out:
    if e["name"] not in seen:
      seen.add(e["name"])
      unique.append(e)
  return unique


def _stamp(entry: dict):
  p = abspath(entry.get("asset") or entry["path"])
  if "asset" in entry:
    p = os.path.join(assets.resolve(p), assets.MANIFEST)
  if not os.path.isfile(p):
    raise ValueError(f"protected eval set {entry['name']!r}: {p} is missing")
  st = os.stat(p)
  return (entry["name"], p, st.st_mtime_ns, st.st_size, tuple(entry.get("fields") or ()))


def build_index(eval_sets="default", *, n: int = 13, min_tokens: int = 8,
                registry: str = REGISTRY) -> EvalIndex:
  """The index of the selected evaluation sets (cached per process, keyed by the files'
  mtimes and sizes)."""
  if n < 1 or not 1 <= min_tokens <= n:
    raise ValueError(f"decontam n={n} must be >= 1 and min_tokens={min_tokens} in [1, n]")
  entries = _select(eval_sets, registry)
  key = (tuple(_stamp(e) for e in entries), n, min_tokens)
  if key in _CACHE:
    return _CACHE[key]
  grams: dict[int, dict[int, tuple]] = {}
  rows, skipped = {}, {}
  for entry in entries:
    name = entry["name"]
    data = read_rows(entry)
    rows[name], skipped[name] = len(data), 0
    for r, row in enumerate(data):
      for text in row_texts(entry, row):
        tokens = normalize(text)
        if len(tokens) < min_tokens:
          skipped[name] += bool(tokens)
          continue
        length = min(n, len(tokens))
        table = grams.setdefault(length, {})
        where = (name, r, text)
        for h in map(hash, _grams(tokens, length)):
          table.setdefault(h, where)
  index = EvalIndex(n=n, min_tokens=min_tokens, sets=[e["name"] for e in entries],
                    grams=grams, rows=rows, skipped_short=skipped)
  _CACHE[key] = index
  return index


# --- Checking training rows ---


@dataclasses.dataclass
class Overlap:
  row: int          # training row index
  eval_set: str     # of the first match in reading order
  eval_row: int     # row index in the evaluation file (0-based; csv: data rows)
  ngram: str        # the matched normalized tokens
  eval_text: str    # the evaluation text it came from
  matches: int      # distinct matched n-grams in this training row
  eval_sets: list[str]  # every evaluation set this row matches


@dataclasses.dataclass
class Report:
  rows: int
  overlaps: list[Overlap]
  sets: list[str]

  @property
  def fraction(self) -> float:
    return len(self.overlaps) / self.rows if self.rows else 0.0

  def by_set(self) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in self.overlaps:
      out[o.eval_set] = out.get(o.eval_set, 0) + 1
    return out

  def describe(self, labels: Sequence[str] | None = None, limit: int = 10) -> str:
    """Lines naming the first `limit` overlapping rows (labels[row] when given)."""
    lines = []
    for o in self.overlaps[:limit]:
      where = labels[o.row] if labels is not None else f"row {o.row}"
      lines.append(f"  {where}: {o.eval_set} row {o.eval_row} ({o.matches} n-gram(s)), "
                   f"e.g. {o.ngram!r}")
    if len(self.overlaps) > limit:
      lines.append(f"  ... and {len(self.overlaps) - limit} more")
    return "\n".join(lines)


def check_rows(texts: Sequence, index: EvalIndex, n: int | None = None) -> Report:
  """Which training rows share an n-gram with the index. A row is a string, or a sequence or
  dict of strings (n-grams never span two of its strings)."""
  if n is not None and n != index.n:
    raise ValueError(f"check_rows n={n} but the index was built with n={index.n}")
  tables = sorted(index.grams.items())
  overlaps = []
  for r, row in enumerate(texts):
    segments = [normalize(s) for s in strings(row)]
    hits: dict[int, tuple] = {}
    for length, table in tables:
      for tokens in segments:
        if len(tokens) < length:
          continue
        for h in table.keys() & set(map(hash, _grams(tokens, length))):
          hits.setdefault(h, (length, table[h]))
    if not hits:
      continue
    # The first matched n-gram in reading order names the overlap.
    gram, (name, eval_row, eval_text) = next(
        (g, hits[hash(g)][1]) for tokens in segments for length, _ in tables
        for g in _grams(tokens, length) if hash(g) in hits)
    sets = sorted({where[0] for _, where in hits.values()})
    overlaps.append(Overlap(r, name, eval_row, " ".join(gram), eval_text, len(hits), sets))
  return Report(rows=len(texts), overlaps=overlaps, sets=list(index.sets))


# --- The training-run hook ---

_CHECKED: dict = {}  # (index id, digest of the rows) -> Report: loaders run once per shard


def _checked(texts: Sequence, index: EvalIndex) -> Report:
  h = hashlib.blake2b(digest_size=16)
  for row in texts:
    for s in strings(row):
      h.update(s.encode("utf-8", "surrogatepass"))
      h.update(b"\x00")
    h.update(b"\x01")
  key = (id(index), h.hexdigest())
  if key not in _CHECKED:
    if len(_CHECKED) > 64:
      _CHECKED.clear()
    _CHECKED[key] = check_rows(texts, index)
  return _CHECKED[key]


def _cfg(decontam) -> dict:
  cfg = dict(DEFAULTS)
  if decontam is not None:
    given = decontam.to_dict() if hasattr(decontam, "to_dict") else dict(decontam)
    unknown = set(given) - set(DEFAULTS)
    if unknown:
      raise ValueError(f"data.decontam: unknown key(s) {sorted(unknown)}; known: "
                       f"{sorted(DEFAULTS)}")
    cfg.update(given)
  if not 0.0 <= float(cfg["max_overlap_rows"]) <= 1.0:
    raise ValueError(f"data.decontam.max_overlap_rows={cfg['max_overlap_rows']} is a fraction "
                     "of rows and must be in [0, 1]")
  return cfg


def enforce(texts: Sequence, decontam: Mapping[str, Any] | None = None, *, labels=None,
            what: str = "training data", registry: str = REGISTRY) -> Report | None:
  """The training-run check. Raises ValueError when the fraction of rows of `texts` that
  overlap a protected evaluation set exceeds data.decontam.max_overlap_rows (0: any row),
  unless data.decontam.allow, which prints a warning with the count instead.

  `decontam`: config data.decontam (DEFAULTS for missing keys; None: all defaults).
  `labels` name the rows in messages (e.g. "file.jsonl:12"; or a function returning them,
  called only on overlap). Returns the report (None: eval_sets empty)."""
  cfg = _cfg(decontam)
  index = build_index(cfg["eval_sets"], n=int(cfg["n"]), min_tokens=int(cfg["min_tokens"]),
                      registry=registry)
  if not index.sets:
    return None
  report = _checked(texts, index)
  limit = float(cfg["max_overlap_rows"])
  if not report.overlaps or report.fraction <= limit:
    return report
  if callable(labels):
    labels = labels()
  head = (f"{what}: {len(report.overlaps)} of {report.rows} rows share {index.n}-grams with "
          f"protected evaluation sets {report.by_set()} (checked: {', '.join(index.sets)}; "
          f"allowed fraction data.decontam.max_overlap_rows={limit})")
  if cfg["allow"]:
    print(f"WARNING: {head}; training on them anyway (data.decontam.allow=True)\n"
          f"{report.describe(labels)}", file=sys.stderr, flush=True)
    return report
  raise ValueError(f"{head}:\n{report.describe(labels)}\nDrop these rows (`meshlm data "
                   "decontam FILE ROOT` writes the file's clean rows as a data asset), or "
                   "override with --config.data.decontam.allow=True")


def check_records(data_cfg: Mapping[str, Any], items: Sequence[tuple]) -> Report | None:
  """align/datasets.py's hook: `items` are (where "path:line", record) of a training split;
  every string in a record is checked (chosen and rejected transcripts, messages, prompt)."""
  return enforce([record for _, record in items], data_cfg.get("decontam"),
                 labels=[where for where, _ in items],
                 what=f"training data {data_cfg.get('path')!r}")


def check_documents(data_cfg: Mapping[str, Any], docs: Sequence[str], files: Sequence[str],
                    read=None) -> Report | None:
  """train/data.py's hook: `docs` of a training split read from `files`; `read(file)` gives
  one file's documents, used (only when a document overlaps) to name its file and position."""
  def labels():
    where: dict[str, tuple] = {}
    for f in files:
      for j, d in enumerate(read(f) if read is not None else ()):
        where.setdefault(d, (f, j))
    located = [where.get(d, (None, i)) for i, d in enumerate(docs)]
    return [f"{f} document {j}" if f else f"document {j}" for f, j in located]

  return enforce(docs, data_cfg.get("decontam"), labels=labels,
                 what=f"training data {data_cfg.get('path')!r}")


# --- Dropping overlapping rows at the root: a clean data asset ---


def _read_source(path: str) -> tuple[list[int], list[dict]]:
  """(0-based line numbers, rows) of the non-blank lines of a .jsonl(.gz) file of objects."""
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file")
  lines, rows = [], []
  for i, row in jsonl_lines(path):
    if not isinstance(row, dict):
      raise ValueError(f"{path}:{i + 1}: a {type(row).__name__}, not a JSON object")
    lines.append(i)
    rows.append(row)
  return lines, rows


def _set_ref(entry: dict, rows: int) -> dict:
  """Which version of an evaluation set was checked: its rows and file (or content) hash."""
  if "asset" in entry:
    m = assets.read_manifest(abspath(entry["asset"]))
    return {"name": entry["name"], "asset": entry["asset"], "rows": rows,
            "content_sha256": m["content_sha256"]}
  return {"name": entry["name"], "path": entry["path"], "rows": rows,
          "sha256": assets.sha256_file(abspath(entry["path"]))}


def write_decontaminated(source: str, root: str, name: str, *, eval_sets="default",
                         n: int = 13, min_tokens: int = 8, registry: str = REGISTRY,
                         kind: str = "train") -> str:
  """Writes ROOT/NAME/vK (train/assets.py): the rows of the JSONL(.gz) file `source`, in
  order, less those sharing an n-gram with the selected evaluation sets (which are only
  read). The manifest's "decontaminated" field names the sets (with their hashes), the
  method, and counts the rows dropped, per set and by 0-based source line
  (`dropped_rows`). The same source and sets always drop the same rows. Returns the
  version dir."""
  lines, rows = _read_source(source)
  index = build_index(eval_sets, n=n, min_tokens=min_tokens, registry=registry)
  if not index.sets:
    raise ValueError(f"eval_sets={eval_sets!r} selects no evaluation set to decontaminate "
                     "against")
  report = check_rows(rows, index)
  bad = {o.row for o in report.overlaps}
  entries = _select(eval_sets, registry)
  record = {
      "against": [_set_ref(e, index.rows[e["name"]]) for e in entries],
      "method": (f"{n}-gram overlap after GPT-3 normalisation (lowercase, punctuation "
                 f"deleted, split on whitespace); evaluation texts under {min_tokens} tokens "
                 f"not indexed, those under {n} matched whole (train/decontam.py)"),
      "n": n, "min_tokens": min_tokens, "source_rows": len(rows),
      "kept": len(rows) - len(bad), "dropped": len(bad), "dropped_by_set": report.by_set(),
      "dropped_rows": [lines[o.row] for o in report.overlaps]}
  return assets.write_asset(root, name, [r for i, r in enumerate(rows) if i not in bad],
                            kind=kind, lineage={"source": assets.file_ref(source)},
                            extra={"decontaminated": record})
