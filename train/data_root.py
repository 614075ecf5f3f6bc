"""Where meshlm's data/ folder is: the datasets, evaluation sets and protected-evaluation
registry that configs, `meshlm eval` and the decontamination check read.

In a checkout (or an editable install) it is the checkout's data/. A wheel carries a copy
as the package `meshlm_data` (pyproject.toml). MESHLM_DATA=DIR names another folder.
"""

import importlib.util
import os

ENV = "MESHLM_DATA"
_CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def data_dir() -> str:
  """The data/ folder (module docstring). Where none is found, the checkout's path, which
  then does not exist: each reader's error names the file it missed."""
  if os.environ.get(ENV):
    return os.path.abspath(os.path.expanduser(os.environ[ENV]))
  if os.path.isdir(_CHECKOUT):
    return _CHECKOUT
  spec = importlib.util.find_spec("meshlm_data")
  if spec is not None and spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  return _CHECKOUT


def resolve(path: str, root: str) -> str:
  """A path as the registry and configs write it: absolute, "data/..." (under data_dir()),
  or relative to `root` (the repository)."""
  if os.path.isabs(path):
    return path
  head, _, rest = path.replace(os.sep, "/").partition("/")
  return data_path(rest) if head == "data" and rest else os.path.join(root, path)


def data_path(*parts: str) -> str:
  """A path under data/ (it may not exist: the caller names what is missing)."""
  return os.path.join(data_dir(), *parts)
