"""experiments/colab_quickstart.ipynb runs end to end: every cell, in a real Jupyter kernel,
with tiny sizes (its TINY parameter) on CPU. It pretrains, runs DPO and evaluates through the
real `meshlm` command line, so the notebook cannot drift from the CLI unnoticed; any cell
that raises fails the test (and CI).

The parameters are overridden the way papermill does it: a cell inserted after the one
tagged "parameters". meshlm is already installed here, so the notebook's install cell skips
installing (it never touches the network in CI). Where it would install from (the checkout
the notebook sits in, else a clone of MESHLM_REPO) is checked by running that cell with pip,
git and the import lookup stubbed.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import deps

nbformat = deps.require("nbformat")
nbclient = deps.require("nbclient")
deps.require("ipykernel")  # the notebook's python3 kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "experiments", "colab_quickstart.ipynb")

# SmolLM2 judges the helpful win rates, as in the notebook's default run.
deps.smollm()
TINY = {"STEPS": 30, "DPO_STEPS": 4, "EVAL_LIMIT": 1, "EVAL_MAX_NEW_TOKENS": 8,
        "EVAL_BASELINE": True, "JUDGE": "smollm2", "TINY": True}


def with_parameters(nb, values: dict):
  """A copy of `nb` with a cell setting `values` inserted after its "parameters" cell."""
  index = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert index == [1], f"the notebook needs one parameters cell, second: {index}"
  source = "# Injected by tests/test_colab_notebook.py\n" + "".join(
      f"{k} = {v!r}\n" for k, v in values.items())
  cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
  nb = nbformat.from_dict(json.loads(json.dumps(nb)))
  nb.cells.insert(index[0] + 1, cell)
  return nb


def test_parameters_cell_declares_what_the_test_overrides():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  params = nb.cells[1]
  assert "parameters" in params.metadata.get("tags", [])
  for name in [*TINY, "WORKDIR", "MESHLM_REPO"]:
    assert f"\n{name} = " in "\n" + params.source, name
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "commit the notebook without outputs"


def test_notebook_runs_end_to_end_on_cpu(tmp_path):
  workdir = tmp_path / "colab"
  nb = with_parameters(nbformat.read(NOTEBOOK, as_version=4),
                       {**TINY, "WORKDIR": str(workdir)})
  # Every JAX program runs in a child process: a TPU admits one process, and a kernel that
  # started JAX on a GPU would hold most of its memory.
  nb.cells.append(nbformat.v4.new_code_cell(
      'import sys\nassert "jax" not in sys.modules, "the notebook kernel imported JAX"'))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"a notebook cell failed:\n{str(e)[-6000:]}")

  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, errors
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs if o.output_type == "stream")
  assert "backend: cpu" in text
  assert "meshlm: goodput" in text  # the training runs' own summary line

  # the two plotting cells showed three figures: losses, metrics, dimension scores
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "display_data" and "image/png" in o.get("data", {})]
  assert len(images) >= 3, [c.outputs for c in nb.cells[-4:]]

  for run in ("pretrain", "dpo"):
    with open(workdir / run / "metrics.jsonl") as f:
      rows = [json.loads(line) for line in f]
    assert rows and all(r["loss"] == r["loss"] for r in rows if "loss" in r)
  assert max(r["step"] for r in rows) == TINY["DPO_STEPS"]
  for out in ("eval_pretrain", "eval_dpo"):
    report = json.loads((workdir / out / "report.json").read_text())
    assert report["suite"] == "hhh" and report["limit"] == TINY["EVAL_LIMIT"]
    assert set(report["dimensions"]) == {"helpful", "harmless", "honest"}
    win_rates = {"helpful/alpaca_eval_win_rate", "helpful/mt_bench_win_rate"}
    assert win_rates <= set(report["metrics"]), sorted(report["metrics"])
    assert (workdir / out / "report.html").stat().st_size > 0


FIND_SPEC = importlib.util.find_spec  # the real one: a second stub must not wrap the first


def run_install_cell(monkeypatch, cwd, repo_url, clone_dir):
  """The notebook's install cell run in `cwd` as if meshlm were not installed, with every
  subprocess (git, pip) recorded instead of run: returns the commands."""
  cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
           if c.cell_type == "code" and "def meshlm_checkout" in c.source]
  assert len(cells) == 1
  calls, installed = [], []

  def stub_find_spec(name, *args):
    missing = name in ("cli.main", "experiments.quickstart") and not installed
    return None if missing else FIND_SPEC(name, *args)

  def stub_run(cmd, **kwargs):
    calls.append([str(a) for a in cmd])
    installed.extend(["-e"] if "-e" in cmd else [])
    return subprocess.CompletedProcess(cmd, 0)

  monkeypatch.setattr(importlib.util, "find_spec", stub_find_spec)
  monkeypatch.setattr(subprocess, "run", stub_run)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the cell puts the source first
  monkeypatch.chdir(cwd)
  exec(cells[0], {"MESHLM_REPO": repo_url, "MESHLM_DIR": str(clone_dir), "JUDGE": ""})
  return calls


def editable_source(calls):
  return [c[c.index("-e") + 1] for c in calls if "-e" in c]


def test_install_cell_installs_the_checkout_it_sits_in(monkeypatch, tmp_path):
  placeholder = "https://github.com/<org>/meshlm.git"
  calls = run_install_cell(monkeypatch, os.path.join(REPO, "experiments"), placeholder,
                           tmp_path / "clone")
  assert editable_source(calls) == [REPO] and not any("git" in c for c in calls), calls

  fork = tmp_path / "fork"
  (fork / "experiments").mkdir(parents=True)
  (fork / "pyproject.toml").write_text('[project]\nname = "meshlm"\n')
  calls = run_install_cell(monkeypatch, fork / "experiments", placeholder, tmp_path / "clone")
  assert editable_source(calls) == [str(fork)], calls


def test_install_cell_clones_outside_a_checkout(monkeypatch, tmp_path):
  other = tmp_path / "other"
  other.mkdir()
  (other / "pyproject.toml").write_text('[project]\nname = "not-meshlm"\n')
  with pytest.raises(RuntimeError, match="set MESHLM_REPO"):
    run_install_cell(monkeypatch, other, "https://github.com/<org>/meshlm.git", tmp_path / "c")
  url, clone = "https://example.org/fork/meshlm.git", tmp_path / "clone"
  calls = run_install_cell(monkeypatch, other, url, clone)
  assert calls[0] == ["git", "clone", "--depth", "1", url, str(clone)], calls
  assert editable_source(calls) == [str(clone)], calls
