"""Code rules checked by tools rather than by review."""

import ast
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["parallel", "models", "train", "infer", "align", "experiments"]


def test_no_private_names_across_modules():
  """No module reaches into another's underscore names: SLF001 (private member access) and
  PLC2701 (import of a private name; a preview rule, hence --preview)."""
  cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--preview",
         "--select", "SLF001,PLC2701", *PACKAGES]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, f"{' '.join(cmd[1:])}:\n{proc.stdout}{proc.stderr}"


def test_no_private_imports_within_a_package():
  """PLC2701 lets a module import its own package's private names (`from models.layers import
  _x` in models/); those cross modules too."""
  found = []
  for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ImportFrom) and (node.level
                                               or node.module.split(".")[0] in PACKAGES):
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
  assert not found, "private names imported from another module:\n" + "\n".join(found)
