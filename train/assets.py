"""Versioned data assets: prompt pools, preference pairs, synthetic instructions, review results.

Layout: ROOT/NAME/vK/ holds `data.jsonl` (or `data.parquet`) and `manifest.json`:
  {name, version, kind, schema_version, created, command, format, file, rows,
   content_sha256, columns {col: type}, lineage}, plus the writer's `extra` fields (e.g.
  "decontaminated": what train/decontam.py dropped from the source, checked on reading)
`content_sha256` is the sha256 of the data file's bytes; `read_asset` re-checks it. `lineage`
is the caller's dict: source files (`file_ref`), input assets (`asset_ref`), teacher checkpoint,
rubric, thresholds, seeds.

Writes are atomic: the version is built in a hidden temp dir beside it (ROOT/NAME/.tmp-*),
fsynced, then renamed to vK; a half-written version is never visible to `latest_version`,
`read_asset` or `list_assets`. Two writers racing for vK: the rename of the second fails
(target exists) and it takes vK+1.
"""

import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from typing import Any, Sequence

from train.report_paths import portable_path

SCHEMA_VERSION = 1
FORMATS = {"jsonl": "data.jsonl", "parquet": "data.parquet"}
MANIFEST = "manifest.json"
_VERSION_RE = re.compile(r"^v([1-9][0-9]*)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_MANIFEST_KEYS = ("name", "version", "kind", "schema_version", "created", "command", "format",
                  "file", "rows", "content_sha256", "columns", "lineage")


# --- Hashes and lineage entries ---


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def row_hash(row: dict) -> str:
  """A row's identity for diffs: sha256 of its canonical JSON (key order ignored)."""
  return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def file_ref(path: str) -> dict:
  """Lineage entry for a source file."""
  if not os.path.isfile(path):
    raise ValueError(f"file_ref: {path!r} is not a file")
  return {"path": path, "sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def asset_ref(path: str) -> dict:
  """Lineage entry for an input asset (a version dir, or ROOT/NAME = its latest version)."""
  vdir = resolve(path)
  m = read_manifest(vdir)
  return {"path": vdir, "name": m["name"], "version": m["version"],
          "content_sha256": m["content_sha256"], "rows": m["rows"]}


def command_line() -> str:
  """The command that is creating an asset, e.g. "meshlm pairs --config experiments/x.py";
  `python -m cli.main ...` is the same meshlm command, and any other script is named by a
  portable path (a manifest is committed: no host path in it)."""
  argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
  parts = os.path.normpath(argv0).split(os.sep)
  if os.path.basename(argv0) == "meshlm" or parts[-2:] == ["cli", "main.py"]:
    return ("meshlm " + shlex.join(sys.argv[1:])).strip()
  prog = f"{os.path.basename(sys.executable or 'python')} {portable_path(argv0) if argv0 else ''}"
  return (prog.strip() + " " + shlex.join(sys.argv[1:])).strip()


# --- Rows and columns ---


def _type_name(v: Any) -> str:
  if v is None:
    return "null"
  for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                  (list, "list"), (dict, "dict")):
    if isinstance(v, t):
      return name
  return type(v).__name__


def _columns(rows: Sequence[dict]) -> dict:
  """{column: type}, types joined with "|" when rows disagree (e.g. "null|str")."""
  seen: dict[str, set] = {}
  for row in rows:
    for k, v in row.items():
      seen.setdefault(k, set()).add(_type_name(v))
  return {k: "|".join(sorted(t)) for k, t in seen.items()}


def _encode_rows(rows: Sequence[dict]) -> list[str]:
  """One JSON line per row; a clear error for a row that is not a dict of JSON values."""
  if isinstance(rows, (str, bytes, dict)):
    raise ValueError(f"rows must be a sequence of dicts, got {type(rows).__name__}")
  lines = []
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      raise ValueError(f"row {i} is a {type(row).__name__}, not a dict")
    bad = [k for k in row if not isinstance(k, str)]
    if bad:
      raise ValueError(f"row {i}: keys must be strings, got {bad[:3]!r}")
    try:
      lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as e:
      raise ValueError(f"row {i} is not JSON-serializable: {e}") from None
  return lines


def _pyarrow():
  try:
    import pyarrow
    import pyarrow.parquet
  except ImportError:
    raise ValueError("fmt='parquet' needs pyarrow, which is not installed; "
                     "use fmt='jsonl' or `pip install pyarrow`") from None
  return pyarrow


# --- Writing ---


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return  # platforms without directory fds: the rename is still atomic
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _versions(root: str, name: str) -> list[int]:
  """Complete versions (those with a manifest), ascending."""
  adir = os.path.join(root, name)
  if not os.path.isdir(adir):
    return []
  out = []
  for entry in os.listdir(adir):
    m = _VERSION_RE.match(entry)
    if m and os.path.isfile(os.path.join(adir, entry, MANIFEST)):
      out.append(int(m.group(1)))
  return sorted(out)


def write_asset(root: str, name: str, rows: Sequence[dict], *, kind: str, lineage: dict,
                command: str | None = None, fmt: str = "jsonl", extra: dict | None = None
                ) -> str:
  """Atomically writes ROOT/NAME/vK (K = next version, v1 first); returns the version dir.
  `extra`: more top-level manifest fields (not the standard keys)."""
  if not isinstance(name, str) or not _NAME_RE.match(name):
    raise ValueError(f"asset name {name!r}: use letters, digits and ._+- (no slashes), "
                     "starting with a letter or digit")
  if not isinstance(kind, str) or not kind:
    raise ValueError(f"asset kind {kind!r} must be a non-empty string")
  if fmt not in FORMATS:
    raise ValueError(f"asset format {fmt!r}; choose one of {sorted(FORMATS)}")
  if not isinstance(lineage, dict):
    raise ValueError(f"lineage must be a dict, got {type(lineage).__name__}")
  extra = dict(extra or {})
  clash = sorted(set(extra) & set(_MANIFEST_KEYS))
  if clash:
    raise ValueError(f"extra manifest fields {clash} would replace standard ones")
  try:
    json.dumps([lineage, extra], allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"lineage or extra is not JSON-serializable: {e}") from None
  rows = list(rows) if not isinstance(rows, (str, bytes, dict)) else rows
  lines = _encode_rows(rows)
  fname = FORMATS[fmt]

  adir = os.path.join(root, name)
  os.makedirs(adir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=adir)
  try:
    data_path = os.path.join(tmp, fname)
    if fmt == "jsonl":
      with open(data_path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
        f.flush()
        os.fsync(f.fileno())
    else:
      pa = _pyarrow()
      table = pa.Table.from_pylist(list(rows))
      pa.parquet.write_table(table, data_path)
      with open(data_path, "rb") as f:
        os.fsync(f.fileno())
    manifest = {"name": name, "version": 0, "kind": kind, "schema_version": SCHEMA_VERSION,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "command": command if command is not None else command_line(),
                "format": fmt, "file": fname, "rows": len(lines),
                "content_sha256": sha256_file(data_path), "columns": _columns(rows),
                "lineage": lineage, **extra}
    # Claim the next free vK by renaming; a racing writer that took vK first makes it fail.
    for _ in range(1000):
      version = (_versions(root, name) or [0])[-1] + 1
      manifest["version"] = version
      with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
      _fsync_dir(tmp)
      vdir = os.path.join(adir, f"v{version}")
      try:
        os.rename(tmp, vdir)
      except OSError:
        if os.path.isfile(os.path.join(vdir, MANIFEST)):
          continue  # lost the race for vK
        if os.path.exists(vdir):  # a leftover without manifest would block vK forever
          raise ValueError(f"{vdir} exists but has no {MANIFEST}: remove it by hand") from None
        raise
      _fsync_dir(adir)
      return vdir
    raise RuntimeError(f"could not claim a version under {adir}")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


# --- Reading ---


def latest_version(root: str, name: str) -> str | None:
  """The latest complete version dir of ROOT/NAME, or None when there is none."""
  versions = _versions(root, name)
  return os.path.join(root, name, f"v{versions[-1]}") if versions else None


def resolve(path: str) -> str:
  """A version dir: `path` itself when it holds a manifest, else its latest version."""
  if os.path.isfile(os.path.join(path, MANIFEST)):
    return path
  if os.path.isdir(path):
    root, name = os.path.split(os.path.normpath(path))
    latest = latest_version(root, name)
    if latest:
      return latest
    raise ValueError(f"{path}: no {MANIFEST} and no complete versions (v1, v2, ...) inside")
  raise ValueError(f"{path}: no such asset directory")


def read_manifest(path: str) -> dict:
  """The manifest of a version dir (or of ROOT/NAME's latest version), checked for its keys."""
  mpath = os.path.join(resolve(path), MANIFEST)
  try:
    with open(mpath, encoding="utf-8") as f:
      manifest = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{mpath}: bad JSON ({e})") from None
  if not isinstance(manifest, dict):
    raise ValueError(f"{mpath}: expected a JSON object, got {type(manifest).__name__}")
  missing = [k for k in _MANIFEST_KEYS if k not in manifest]
  if missing:
    raise ValueError(f"{mpath}: missing keys {missing}")
  if manifest["format"] not in FORMATS or manifest["file"] != FORMATS[manifest["format"]]:
    raise ValueError(f"{mpath}: format {manifest['format']!r} / file {manifest['file']!r} "
                     f"not one of {FORMATS}")
  if not isinstance(manifest["schema_version"], int) or \
      manifest["schema_version"] > SCHEMA_VERSION:
    raise ValueError(f"{mpath}: schema_version {manifest['schema_version']!r} is not an "
                     f"integer up to this code's {SCHEMA_VERSION}")
  if "decontaminated" in manifest:
    _check_decontaminated(manifest, mpath)
  return manifest


def _check_decontaminated(manifest: dict, where: str) -> None:
  """A "decontaminated" record must add up: kept == rows, kept + dropped == source_rows and
  one source row index per dropped row."""
  d = manifest["decontaminated"]
  counts = ("source_rows", "kept", "dropped")
  if not isinstance(d, dict) or not all(isinstance(d.get(k), int) and d[k] >= 0
                                        for k in counts):
    raise ValueError(f"{where}: decontaminated needs non-negative integers {counts}")
  if not isinstance(d.get("against"), list) or not d["against"]:
    raise ValueError(f"{where}: decontaminated.against must name the evaluation sets checked")
  dropped_rows = d.get("dropped_rows")
  if (d["kept"] != manifest["rows"] or d["kept"] + d["dropped"] != d["source_rows"] or
      not isinstance(dropped_rows, list) or len(dropped_rows) != d["dropped"]):
    raise ValueError(f"{where}: decontaminated counts do not add up: rows {manifest['rows']}, "
                     f"kept {d['kept']}, dropped {d['dropped']} of {d['source_rows']} "
                     f"source rows, {len(dropped_rows or [])} dropped row indices")


def read_asset(path: str) -> list[dict]:
  """The rows of a version dir (or of ROOT/NAME's latest version), after checking the content
  hash and row count against the manifest."""
  vdir = resolve(path)
  manifest = read_manifest(vdir)
  data_path = os.path.join(vdir, manifest["file"])
  if not os.path.isfile(data_path):
    raise ValueError(f"{data_path}: data file named by the manifest is missing")
  digest = sha256_file(data_path)
  if digest != manifest["content_sha256"]:
    raise ValueError(f"{data_path}: content sha256 {digest[:12]}... does not match the "
                     f"manifest's {str(manifest['content_sha256'])[:12]}... (file changed or "
                     "corrupt)")
  if manifest["format"] == "jsonl":
    rows = []
    with open(data_path, encoding="utf-8") as f:
      for i, line in enumerate(f, 1):
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{data_path}:{i}: bad JSON ({e})") from None
  else:
    rows = _pyarrow().parquet.read_table(data_path).to_pylist()
  if len(rows) != manifest["rows"]:
    raise ValueError(f"{data_path}: {len(rows)} rows, manifest says {manifest['rows']}")
  return rows


def list_assets(root: str) -> list[dict]:
  """Manifests of every complete version under ROOT (sorted by name, version); each gets a
  "path" key. Unreadable manifests are listed with an "error" key instead of raising."""
  if not os.path.isdir(root):
    raise ValueError(f"{root}: no such directory")
  parent, base = os.path.split(os.path.normpath(root))
  if _versions(parent, base):  # ROOT/NAME given: that asset's versions
    root, names = parent, [base]
  else:
    names = sorted(n for n in os.listdir(root)
                   if not n.startswith(".") and os.path.isdir(os.path.join(root, n)))
  out = []
  for name in names:
    for version in _versions(root, name):
      vdir = os.path.join(root, name, f"v{version}")
      try:
        out.append({**read_manifest(vdir), "path": vdir})
      except ValueError as e:
        out.append({"name": name, "version": version, "path": vdir, "error": str(e)})
  return out
