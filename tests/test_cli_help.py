"""`meshlm --help` and `meshlm CMD --help` for every command, unknown commands, bad flags,
and the dash spelling of flag names (cli/main.py, cli/parsing.py)."""

import importlib
import json
import subprocess
import sys

import pytest

from align.evals.stats import metric
from cli import main as cli_main
from cli.generate import make_flags as generate_flags
from cli.parsing import normalize
from conftest import REPO


def _run(argv, capsys):
  """(exit status, stdout, stderr) of cli.main.main(argv), in this process."""
  try:
    code = cli_main.main(argv)
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code or 0, out, err


def test_top_level_help_lists_every_command_with_a_description(capsys):
  for argv in (["--help"], ["-h"], []):
    code, out, _ = _run(argv, capsys)
    assert code == 0
    for name, (_, description) in cli_main.COMMANDS.items():
      assert f"  {name} " in out and description in out, name


def test_help_of_the_installed_program():
  """One real process: the `meshlm` entry point's module, with no JAX on the way."""
  run = subprocess.run([sys.executable, "-m", "cli.main", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
  assert run.returncode == 0, run.stderr
  assert "serve" in run.stdout and "meshlm COMMAND --help" in run.stdout


@pytest.mark.parametrize("command", list(cli_main.COMMANDS))
def test_every_command_help_lists_each_of_its_flags(command, capsys):
  fv = importlib.import_module(cli_main.COMMANDS[command][0]).make_flags([])
  assert len(list(fv)) >= 2
  for flag in ("--help", "-h"):
    code, out, _ = _run([command, flag], capsys)
    assert code == 0, out
    assert out.startswith("`meshlm "), out[:200]  # the command's usage first
    for name in fv:
      spelled = f"--[no]{name}:" if fv[name].boolean else f"--{name}:"
      assert spelled in out, f"meshlm {command} --help does not list {spelled}"
      missing = [w for w in fv[name].help.split() if w not in out]
      assert not missing, f"{spelled} help text: {missing}"


def test_unknown_command_exits_2_and_lists_the_commands(capsys):
  code, out, err = _run(["trian", "--config", "x.py"], capsys)
  assert code == 2 and not out
  assert "unknown command 'trian'" in err
  assert err.count("\n") == 1 and all(f" {name}," in err or f" {name} (" in err
                                       for name in cli_main.COMMANDS), err


def test_bad_and_missing_flags_exit_2_naming_the_flag(capsys):
  code, _, err = _run(["gate", "--baseline", "a.json", "--max_dorp", "0.1"], capsys)
  assert code == 2 and "max_dorp" in err and "meshlm gate --help" in err
  code, _, err = _run(["gate", "--baseline", "a.json"], capsys)
  assert code == 2 and "missing required flag --candidate" in err
  code, _, err = _run(["embed", "--model", "m", "--batch_size", "many"], capsys)
  assert code == 2 and "batch_size" in err
  code, _, err = _run(["data", "ls", "root", "--rows", "3"], capsys)
  assert code == 2 and "--rows does not apply to ls" in err
  code, _, err = _run(["data", "shoe", "x"], capsys)
  assert code == 2 and "unknown action 'shoe'" in err


def test_dash_spelling_is_an_alias_for_the_name_only():
  fv = generate_flags([])
  argv, wants_help = normalize(["--max-new-tokens=5", "--prompt", "--top-k", "--no-chat",
                                "--kv-dtype", "int8", "--config.model.d-model=3", "--",
                                "--top-p"], fv)
  # --prompt's value stays as typed, however flag-like; so does all after "--" and the
  # config override.
  assert argv == ["--max_new_tokens=5", "--prompt", "--top-k", "--nochat", "--kv_dtype",
                  "int8", "--config.model.d-model=3", "--", "--top-p"]
  assert not wants_help
  assert normalize(["--prompt", "-h"], fv) == (["--prompt", "-h"], False)
  assert normalize(["--seed", "1", "-h"], fv)[1]


def test_dash_alias_works_end_to_end(tmp_path, capsys):
  name = "harmless/refusal"
  scores = [1.0] * 150 + [0.0] * 50
  report = {"schema": 1, "suite": "harmless",
            "metrics": {name: metric(name, scores, dimension="harmless", higher_is_better=True)}}
  path, verdict = tmp_path / "report.json", tmp_path / "verdict.json"
  path.write_text(json.dumps(report))
  code, out, _ = _run(["gate", "--baseline", str(path), "--candidate", str(path),
                       "--max-drop", "all=0.25", "--json", str(verdict)], capsys)
  assert code == 0 and "PASSED" in out
  assert json.loads(verdict.read_text())["checks"][0]["tolerance"] == 0.25
