"""Code rules checked by tools rather than by review."""

import ast
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["parallel", "models", "train", "infer", "align", "cli", "experiments"]


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


def test_layers_contract():
  """Packages import only downward (pyproject.toml, [tool.importlinter]): lint-imports."""
  run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lint-imports"),
                        "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr


def project_imports():
  """(module, imported project module, line, inside a function?) for every import statement
  of the layered packages."""
  out = []
  for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
    rel = path.relative_to(REPO)
    module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    in_function = {id(n) for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # `from pkg import mod` depends on pkg.mod (and on pkg's __init__ only for its names)
        base = REPO.joinpath(*node.module.split("."))
        names = [f"{node.module}.{a.name}" if (base / f"{a.name}.py").exists()
                 or (base / a.name / "__init__.py").exists() else node.module
                 for a in node.names]
      else:
        continue
      for name in names:
        if name.split(".")[0] in PACKAGES:
          out.append((module, name, path, node.lineno, id(node) in in_function))
  return out


def test_no_module_level_import_cycles():
  graph = {}
  for module, name, _, _, inside in project_imports():
    if not inside:
      graph.setdefault(module, set()).add(name)
  # Tarjan's strongly connected components over the module graph.
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1 or v in graph.get(v, ()):
        cycles.append(sorted(component))

  for v in list(graph):
    if v not in index:
      visit(v)
  assert not cycles, f"import cycles: {cycles}"


def test_few_in_function_imports_each_with_a_reason():
  """An import of a project module inside a function is kept only where it keeps an
  optional heavy dependency optional; the line (or the one above) says so."""
  inside = [(p, line) for _, _, p, line, i in project_imports() if i]
  assert len(inside) < 20, f"{len(inside)} in-function project imports: {inside}"
  for path, line in inside:
    lines = path.read_text().splitlines()
    said = lines[line - 1] + lines[line - 2]
    assert "#" in said, f"{path.relative_to(REPO)}:{line}: say why this import is here"


def test_kernels_follow_the_target():
  """No library module reads `jax.default_backend()`: a CPU host compiling for a TPU mesh must
  get the TPU's kernels, so every kernel choice asks parallel.platform (the mesh's devices)."""
  found = []
  for path in sorted(p for pkg in ("parallel", "models", "train", "infer", "align")
                     for p in (REPO / pkg).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Attribute) and node.attr == "default_backend":
        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
      if isinstance(node, ast.ImportFrom) and any(a.name == "default_backend" for a in node.names):
        found.append(f"{path.relative_to(REPO)}:{node.lineno} (import)")
  assert not found, "jax.default_backend() in library code (use parallel.platform):\n" + \
      "\n".join(found)
