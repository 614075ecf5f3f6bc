"""A run survives what users do to it: a resume with another model shape is refused before
anything in the workdir changes, `config.steps` at or below the run's step is answered,
and every command that reads a run loads only committed checkpoints, falls back from a
damaged newest one in one line, and changes nothing (issue 56, findings 1, 3 and 4)."""

import hashlib
import os
import shutil

import pytest

from conftest import meshlm, train_tiny
from train.checkpoint import COMMIT_MARKERS, committed_steps
from train.workdir import load_trained

train = train_tiny


@pytest.fixture
def run(tiny_run):
  return tiny_run


def copy_of(run, tmp_path) -> str:
  path = str(tmp_path / "run")
  shutil.copytree(run, path)
  return path


def digest(path) -> dict:
  """Every file under `path`, by relative name, with the SHA-256 of its bytes."""
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
  return out


def no_traceback(stderr: str) -> None:
  assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]


def test_a_shape_changing_resume_is_refused_and_leaves_the_run_as_it_was(run, tmp_path):
  workdir = copy_of(run, tmp_path)
  before = digest(workdir)
  out = train(workdir, "--config.steps=6", "--config.model.num_layers=2")
  assert out.returncode == 2, out.stderr[-3000:]
  assert "has model.num_layers=1; you passed 2" in out.stderr, out.stderr
  no_traceback(out.stderr)
  assert digest(workdir) == before
  _, _, step = load_trained(workdir)  # the run still loads, at its newest step
  assert step == 4


def test_steps_at_the_run_s_step_is_nothing_to_do_and_below_it_is_refused(run, tmp_path):
  workdir = copy_of(run, tmp_path)
  before = digest(workdir)
  same = train(workdir, "--config.steps=4", "--config.model.num_layers=1")
  assert same.returncode == 0, same.stderr[-3000:]
  assert "already at step 4 of config.steps=4: nothing to do" in same.stdout
  assert "{}" not in same.stdout
  below = train(workdir, "--config.steps=3", "--config.model.num_layers=1")
  assert below.returncode == 2, below.stderr[-3000:]
  assert "config.steps=3 is below step 4" in below.stderr
  no_traceback(same.stderr + below.stderr)
  assert digest(workdir) == before


def truncate_data(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      path = os.path.join(root, name)
      if os.sep + "d" + os.sep in path:  # the arrays' data files
        with open(path, "r+b") as f:
          f.truncate(os.path.getsize(path) // 2)


def delete_metadata(step_dir):
  os.remove(os.path.join(step_dir, "state", "_METADATA"))


def empty_folder(step_dir):
  for name in os.listdir(step_dir):
    path = os.path.join(step_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def uncommit(step_dir):
  os.remove(os.path.join(step_dir, "commit_success.txt"))


DAMAGE = {"truncated data": (truncate_data, "checkpoint step 4 unreadable (ValueError: "
                                            "OUT_OF_RANGE"),
          "deleted _METADATA": (delete_metadata, "checkpoint step 4 unreadable ("),
          "emptied step folder": (empty_folder, "checkpoint step 4 was never committed"),
          "no commit marker": (uncommit, "checkpoint step 4 was never committed (no "
                                         "commit_success.txt")}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_reading_a_damaged_newest_checkpoint_falls_back_and_changes_nothing(run, tmp_path,
                                                                           capfd, damage):
  workdir = copy_of(run, tmp_path)
  harm, message = DAMAGE[damage]
  harm(os.path.join(workdir, "checkpoints", "4"))
  before = digest(workdir)
  _, _, step = load_trained(workdir)  # what generate, serve, eval, quantize, embed call
  err = capfd.readouterr().err
  assert step == 2, err
  assert message in err, err
  if "unreadable" in message:
    assert "; using step 2" in err, err
  no_traceback(err)
  assert digest(workdir) == before


def test_generate_falls_back_in_one_line(run, tmp_path):
  workdir = copy_of(run, tmp_path)
  truncate_data(os.path.join(workdir, "checkpoints", "4"))
  out = meshlm("generate", "--model", workdir, "--prompt", "ROMEO:", "--max_new_tokens", "3")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "; using step 2" in lines[0], out.stderr


def test_committed_steps_need_every_marker(tmp_path):
  for step, markers in ((1, COMMIT_MARKERS), (2, COMMIT_MARKERS[:1]), (3, ())):
    os.makedirs(tmp_path / str(step))
    for m in markers:
      (tmp_path / str(step) / m).write_text("")
  (tmp_path / "4.orbax-checkpoint-tmp-1").mkdir()  # a save in flight: not a step
  assert committed_steps(str(tmp_path)) == [1]
