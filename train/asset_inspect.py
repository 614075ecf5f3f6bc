"""Data assets (train/assets.py) as text: the listing, one version and the difference
between two, as `meshlm data ls|show|diff` (cli/data.py) prints them.
"""

import collections
import json

from train import assets

_EXAMPLES = 3


def _short(value, width: int = 160) -> str:
  text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                         sort_keys=True)
  return text if len(text) <= width else text[:width - 3] + "..."


def print_list(root: str, out) -> None:
  entries = assets.list_assets(root)
  if not entries:
    print(f"{root}: no assets", file=out)
    return
  header = ("name", "version", "kind", "rows", "created", "sha256")
  table = [header]
  for m in entries:
    if "error" in m:
      table.append((m["name"], f"v{m['version']}", "?", "?", "?", "ERROR: " + m["error"]))
    else:
      table.append((m["name"], f"v{m['version']}", m["kind"], str(m["rows"]), m["created"],
                    m["content_sha256"][:12]))
  widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
  for row in table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)


def print_show(path: str, rows: int, out) -> None:
  vdir = assets.resolve(path)
  manifest = assets.read_manifest(vdir)
  data = assets.read_asset(vdir)  # also verifies the content hash
  print(f"# {vdir} (content hash verified)", file=out)
  d = manifest.get("decontaminated")
  if d:
    print(f"# decontaminated: dropped {d['dropped']} of {d['source_rows']} source rows "
          f"{d.get('dropped_by_set', {})}, kept {d['kept']}; against "
          f"{', '.join(a.get('name', '?') for a in d['against'])}", file=out)
  print(json.dumps(manifest, indent=2, ensure_ascii=False), file=out)
  shown = data[:max(rows, 0)]
  print(f"# first {len(shown)} of {len(data)} rows", file=out)
  for row in shown:
    print(json.dumps(row, ensure_ascii=False), file=out)


def _flatten(value, prefix: str = "") -> dict:
  """{dotted key: leaf} of nested dicts (lists are leaves)."""
  if isinstance(value, dict) and value:
    out = {}
    for k, v in value.items():
      out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
  return {prefix: value}


def manifest_diff(a: dict, b: dict) -> list[str]:
  """Lines for manifest fields that differ; lineage and columns key by key."""
  lines = []
  for key in ("name", "version", "kind", "schema_version", "format", "rows", "content_sha256",
              "command", "created"):
    if a.get(key) != b.get(key):
      lines.append(f"  {key}: {_short(a.get(key))} -> {_short(b.get(key))}")
  ca, cb = a.get("columns", {}), b.get("columns", {})
  for col in sorted(set(ca) | set(cb)):
    if col not in cb:
      lines.append(f"  columns.{col}: removed ({ca[col]})")
    elif col not in ca:
      lines.append(f"  columns.{col}: added ({cb[col]})")
    elif ca[col] != cb[col]:
      lines.append(f"  columns.{col}: {ca[col]} -> {cb[col]}")
  la, lb = _flatten(a.get("lineage", {}), "lineage"), _flatten(b.get("lineage", {}), "lineage")
  for key in sorted(set(la) | set(lb)):
    if key not in lb:
      lines.append(f"  {key}: removed (was {_short(la[key])})")
    elif key not in la:
      lines.append(f"  {key}: added {_short(lb[key])}")
    elif la[key] != lb[key]:
      lines.append(f"  {key}: {_short(la[key])} -> {_short(lb[key])}")
  return lines


def row_diff(rows_a: list[dict], rows_b: list[dict]) -> tuple[list[dict], list[dict]]:
  """(added, removed): rows of B not in A and of A not in B, as multisets by row hash, in
  their files' order."""
  ca = collections.Counter(assets.row_hash(r) for r in rows_a)
  cb = collections.Counter(assets.row_hash(r) for r in rows_b)
  extra_b, extra_a = cb - ca, ca - cb

  def take(rows, extra):
    out, left = [], dict(extra)
    for r in rows:
      h = assets.row_hash(r)
      if left.get(h, 0) > 0:
        left[h] -= 1
        out.append(r)
    return out

  return take(rows_b, extra_b), take(rows_a, extra_a)


def print_diff(path_a: str, path_b: str, out) -> None:
  va, vb = assets.resolve(path_a), assets.resolve(path_b)
  ma, mb = assets.read_manifest(va), assets.read_manifest(vb)
  ra, rb = assets.read_asset(va), assets.read_asset(vb)
  print(f"# {va} -> {vb}", file=out)
  lines = manifest_diff(ma, mb)
  print("manifest: " + ("identical" if not lines else f"{len(lines)} field(s) differ"), file=out)
  for line in lines:
    print(line, file=out)
  added, removed = row_diff(ra, rb)
  print(f"rows: {len(ra)} -> {len(rb)}; added {len(added)}, removed {len(removed)}, "
        f"unchanged {len(rb) - len(added)}", file=out)
  for label, rows in (("+", added), ("-", removed)):
    for row in rows[:_EXAMPLES]:
      print(f"  {label} {_short(row)}", file=out)
    if len(rows) > _EXAMPLES:
      print(f"  {label} ... {len(rows) - _EXAMPLES} more", file=out)
