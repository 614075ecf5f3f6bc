"""The protected-evaluation registry (data/protected_evals.json) that train/decontam.py checks
training data against.

Entries ("eval_sets"): `name`, `path` (relative to the repository), `format` (jsonl | json |
csv | jsonl.gz), `fields` (the text fields indexed; list values and nested dicts are walked
for strings) and `licence`; or `name` + `asset` (a data-asset directory of kind "eval",
train/assets.py, e.g. a pair builder's held-out prompts; `fields` optional: all string
leaves). Eval row numbers are 0-based (csv: data rows).

There are no waivers: a registry with "acknowledged_overlaps" (an old way to let a training
file keep evaluation rows) is refused; such a file is decontaminated instead (`meshlm data
decontam`, train/decontam.py), dropping the overlapping training rows.
"""

import csv
import gzip
import json
import os
from typing import Iterable, Sequence

from train import assets
from train.data_root import data_path, resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGISTRY = data_path("protected_evals.json")
FORMATS = ("jsonl", "json", "csv", "jsonl.gz")


def strings(value) -> Iterable[str]:
  """The string leaves of a JSON value (a messages list gives its contents)."""
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for v in value.values():
      yield from strings(v)
  elif isinstance(value, (list, tuple)):
    for v in value:
      yield from strings(v)


def load_registry(path: str = REGISTRY) -> list[dict]:
  """The registered evaluation sets, checked: each has name and path/format/fields or asset."""
  try:
    with open(path, encoding="utf-8") as f:
      registry = json.load(f)
  except FileNotFoundError:
    raise ValueError(f"{path}: no protected-evaluation registry there") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: bad JSON ({e})") from None
  entries = registry.get("eval_sets") if isinstance(registry, dict) else None
  if not isinstance(entries, list):
    raise ValueError(f"{path}: expected {{\"eval_sets\": [...]}}")
  if "acknowledged_overlaps" in registry:
    raise ValueError(f"{path}: \"acknowledged_overlaps\" waives overlaps between training "
                     "files and evaluation sets, and waivers are gone: drop the overlapping "
                     "training rows instead (meshlm data decontam FILE ROOT) and remove it")
  names = set()
  for i, e in enumerate(entries):
    _check_entry(e, f"{path}: eval_sets[{i}]")
    if e["name"] in names:
      raise ValueError(f"{path}: eval set name {e['name']!r} registered twice")
    names.add(e["name"])
  return entries


def _check_entry(e, where: str) -> None:
  if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
    raise ValueError(f"{where}: needs a non-empty string 'name'")
  fields = e.get("fields")
  if fields is not None and (not isinstance(fields, list) or
                             not all(isinstance(f, str) for f in fields)):
    raise ValueError(f"{where} ({e['name']}): 'fields' must be a list of strings")
  if "asset" in e:
    return
  if e.get("format") not in FORMATS:
    raise ValueError(f"{where} ({e['name']}): 'format' {e.get('format')!r}; choose one of "
                     f"{FORMATS}")
  if not isinstance(e.get("path"), str) or not fields:
    raise ValueError(f"{where} ({e['name']}): needs 'path' and non-empty 'fields' (or 'asset')")


def register_asset(asset_path: str, *, name: str | None = None,
                   fields: Sequence[str] | None = None, licence: str = "",
                   registry: str = REGISTRY) -> dict:
  """Adds (or replaces, by name) an entry for an asset of kind "eval" to the registry, so
  its rows are protected from then on; returns the entry. The registry is rewritten
  atomically."""
  manifest = assets.read_manifest(asset_path)
  if manifest["kind"] != "eval":
    raise ValueError(f"{asset_path}: asset kind is {manifest['kind']!r}; only kind 'eval' "
                     "assets are registered as protected evaluation sets")
  path = os.path.abspath(asset_path)
  rel = os.path.relpath(path, REPO)
  entry = {"name": name or manifest["name"], "asset": path if rel.startswith("..") else rel,
           "licence": licence or "project-generated"}
  if fields:
    entry["fields"] = list(fields)
  entries = [e for e in load_registry(registry) if e["name"] != entry["name"]] + [entry]
  with open(registry, encoding="utf-8") as f:
    doc = json.load(f)
  doc["eval_sets"] = entries
  tmp = f"{registry}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=2, ensure_ascii=False)
    f.write("\n")
  os.replace(tmp, registry)
  return entry


def abspath(p: str) -> str:
  return resolve(p, REPO)


def read_rows(entry: dict) -> list:
  """The rows of a registered evaluation set (dicts, or any JSON values for json lists)."""
  if "asset" in entry:
    return assets.read_asset(abspath(entry["asset"]))
  path, fmt = abspath(entry["path"]), entry["format"]
  if not os.path.isfile(path):
    raise ValueError(f"protected eval set {entry['name']!r}: {path} is missing")
  if fmt == "csv":
    with open(path, encoding="utf-8-sig", newline="") as f:
      return list(csv.DictReader(f))
  if fmt == "json":
    with open(path, encoding="utf-8") as f:
      rows = json.load(f)
    if not isinstance(rows, list):
      raise ValueError(f"{path}: format json needs a top-level list of rows")
    return rows
  return [row for _, row in jsonl_lines(path, gz=fmt == "jsonl.gz")]


def jsonl_lines(path: str, gz: bool | None = None) -> list[tuple[int, object]]:
  """(0-based line number, value) of each non-blank line of a JSONL file (gzipped when `gz`;
  None: when the name ends in .gz); bad JSON raises ValueError naming the file and (1-based)
  line."""
  opener = gzip.open if (path.endswith(".gz") if gz is None else gz) else open
  out = []
  with opener(path, "rt", encoding="utf-8") as f:
    for i, line in enumerate(f):
      try:
        out.extend([(i, json.loads(line))] if line.strip() else [])
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i + 1}: bad JSON ({e.msg})") from None
  return out


def row_texts(entry: dict, row) -> list[str]:
  fields = entry.get("fields")
  if not fields:
    return list(strings(row))
  if not isinstance(row, dict):
    raise ValueError(f"eval set {entry['name']!r}: rows are {type(row).__name__}, not dicts "
                     "with the registered fields")
  missing = [f for f in fields if f not in row]
  if missing:
    raise ValueError(f"eval set {entry['name']!r}: a row has no field(s) {missing}")
  return [s for f in fields for s in strings(row[f])]
