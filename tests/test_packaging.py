"""What a non-editable install gets: every code package, the data/ folder as the package
meshlm_data and the XLA GPU target configs, enough to run the quickstart outside the checkout
(issue 56). The wheel is built here without its dependencies (they are this venv's)."""

import os
import subprocess
import sys
import tomllib
import zipfile

import pytest
from setuptools import find_packages

from conftest import REPO, TINY_CLI

CODE = ["cli*", "models*", "parallel*", "train*", "align*", "infer*", "experiments*"]


def pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def test_the_package_list_is_every_code_package_and_the_data():
  listed = pyproject()["tool"]["setuptools"]["packages"]
  assert sorted(listed) == sorted(find_packages(REPO, include=CODE) + ["meshlm_data"])
  assert pyproject()["tool"]["setuptools"]["package-dir"]["meshlm_data"] == "data"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp("wheel")
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", REPO, "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=str(out))
  assert build.returncode == 0, build.stderr[-3000:]
  (path,) = [os.path.join(out, n) for n in os.listdir(out) if n.endswith(".whl")]
  return path


def test_the_wheel_carries_the_data_and_the_gpu_targets(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  tracked = subprocess.run(["git", "ls-files", "data"], capture_output=True, text=True,
                           cwd=REPO, check=True).stdout.split()
  missing = [p for p in tracked if "meshlm_data/" + p[len("data/"):] not in names]
  assert not missing, missing[:10]
  assert {"parallel/gpu_targets/h100_sxm.txtpb", "parallel/gpu_targets/a100_sxm_80.txtpb",
          "experiments/quickstart.py", "cli/main.py"} <= names


def test_the_quickstart_runs_from_the_unpacked_wheel(wheel, tmp_path):
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  # The unpacked wheel first on the path, outside the checkout, with the checkout's data/
  # out of reach: what it reads comes from meshlm_data.
  env = dict(os.environ, PYTHONPATH=str(site), MESHLM_DATA="")
  config = str(site / "experiments" / "quickstart.py")
  run = subprocess.run([sys.executable, "-m", "cli.main", "train", "--config", config,
                        "--workdir", str(tmp_path / "run"), *TINY_CLI, "--config.steps=2",
                        "--config.model.num_layers=1", "--config.eval_every=2"],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
  assert run.returncode == 0, run.stderr[-3000:]
  where = subprocess.run([sys.executable, "-c", "import train.data_root as d; "
                          "print(d.data_dir()); print(d.__file__)"],
                         capture_output=True, text=True, cwd=str(tmp_path), env=env, check=True)
  data_dir, module = where.stdout.split()
  assert data_dir == str(site / "meshlm_data") and module.startswith(str(site)), where.stdout
