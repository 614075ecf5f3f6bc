"""Paths as reports write them: never the absolute path of the machine that wrote them.

Reports (`meshlm eval`'s report.json and report.html, benchmark JSON, a quantized
checkpoint's quant.json) get committed and read on other machines, where a path into the
writer's home directory or virtualenv says nothing useful and leaks the writer's layout.
`portable_path` writes instead:

  a relative path               as given (the name the user passed)
  in site- or dist-packages     <packages>/pkg/...
  under the current directory   relative to it      (of these three, the innermost
  under the temp directory      <tmp>/...            directory that holds the path)
  under the home directory      ~/...
  anywhere else                 <abs>/parent/name (the last two parts)
"""

import os
import re
import tempfile

PACKAGES = "<packages>"
TMP = "<tmp>"
ELSEWHERE = "<abs>"
# Characters that end a path inside a longer string (a Prometheus label, a message).
_STOP = r"\s\"'<>,;()\[\]{}="
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _under(path: str, root: str) -> str | None:
  """`path` relative to `root` when it lies inside it (or is it), else None."""
  root = os.path.normpath(root)
  if root == os.sep or not os.path.isabs(root):
    return None  # everything is under "/": no information, and no relative path to write
  if path == root:
    return "."
  prefix = root + os.sep
  return path[len(prefix):] if path.startswith(prefix) else None


def _roots() -> list[tuple[str, str]]:
  """(directory, how it is written) for the host directories, most specific first."""
  named = [(os.getcwd(), ""), (tempfile.gettempdir(), TMP), (os.path.expanduser("~"), "~")]
  # the temp dir may sit inside the home dir or the reverse: the longer root wins
  return sorted(named, key=lambda r: len(os.path.normpath(r[0])), reverse=True)


def portable_path(path) -> str:
  """`path` (str or PathLike) as a report writes it; see the module docstring."""
  path = os.fspath(path)
  if not os.path.isabs(path):
    return path
  path = os.path.normpath(path)
  parts = path.split(os.sep)
  # the innermost package directory: a venv may itself live under the current directory
  hits = [i for i, p in enumerate(parts) if p in _PACKAGE_DIRS]
  if hits:
    return "/".join([PACKAGES, *parts[hits[-1] + 1:]])
  for root, name in _roots():
    rel = _under(path, root)
    if rel is not None:
      rel = rel.replace(os.sep, "/")
      return rel if not name else name if rel == "." else f"{name}/{rel}"
  return "/".join([ELSEWHERE, *[p for p in parts if p][-2:]])


def _host_path_pattern() -> re.Pattern:
  """Absolute paths under a host root (or any site-packages) inside a longer string."""
  roots = {os.path.normpath(r) for r, _ in _roots()}
  alts = [rf"/(?:[^{_STOP}/]+/)*(?:{'|'.join(_PACKAGE_DIRS)})"]
  alts += [re.escape(r) for r in sorted(roots, key=len, reverse=True)
           if os.path.isabs(r) and r != os.sep]
  # not inside a URL or a longer name ("http://h/tmp", "/rootfs" for the root "/root")
  return re.compile(rf"(?<![\w.~/:-])(?:{'|'.join(alts)})(?![^{_STOP}/])[^{_STOP}]*")


def scrub_paths(obj):
  """A copy of the JSON-like `obj` whose strings (keys too) have every absolute host path
  written by `portable_path`; for documents that quote text from elsewhere (a server's
  /metrics labels, a log path)."""
  pattern = _host_path_pattern()

  def walk(x):
    if isinstance(x, str):
      return pattern.sub(lambda m: portable_path(m.group(0)), x)
    if isinstance(x, dict):
      return {walk(k): walk(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [walk(v) for v in x]
    return x
  return walk(obj)
