"""The review page in headless Chromium, driven by Playwright, against a real `meshlm review`
subprocess: labels by clicks and keys, undo, reload persistence, two reviewers at once, the
409 for an already-resolved item, and a SIGKILLed server restarted on the same database.

Needs Debian's Chromium and the playwright Python package (not its downloaded browsers):
  apt-get install -y chromium && pip install 'playwright>=1.60,<2'
Missing either fails the browser tests (tests/deps.py).
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import deps
from align.curate.review_db import ReviewQueue
from test_review_db import fill, hh_items, snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("MESHLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
XSS = '\n<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> & <b>'

try:
  from playwright.sync_api import expect, sync_playwright
except ImportError:  # the browser fixture fails (or skips) naming it: tests/deps.py
  expect = sync_playwright = None


@pytest.fixture(scope="module")
def browser():
  executable = deps.chromium(CHROMIUM)
  expect.set_options(timeout=15_000)
  with sync_playwright() as p:
    b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
    yield b
    b.close()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
  """(status, JSON answer) of GET (body None) or POST to the API."""
  data = None if body is None else json.dumps(body).encode()
  request = urllib.request.Request(url + path, data=data,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=30) as r:
      return r.status, json.load(r)
  except urllib.error.HTTPError as e:
    return e.code, json.load(e)


class Server:
  """`meshlm review --db DB --port PORT` as a subprocess, started and waited for."""

  def __init__(self, db: str, log: str, port: int | None = None):
    self.db, self.port = db, port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    with open(log, "ab") as f:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", "cli.main", "review", "--db", db, "--port", str(self.port)],
          cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    self.log = log
    deadline = time.time() + 60
    while True:
      if self.proc.poll() is not None:
        pytest.fail(f"meshlm review exited with {self.proc.returncode}:\n{open(log).read()}")
      try:
        if call(self.url, "/api/progress")[0] == 200:
          return
      except OSError:
        pass
      if time.time() > deadline:
        self.stop()
        pytest.fail(f"meshlm review did not listen on {self.url} in 60 s:\n{open(log).read()}")
      time.sleep(0.1)

  def stop(self, sig=signal.SIGTERM) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(sig)
      self.proc.wait(timeout=10)


@pytest.fixture
def queue(tmp_path):
  q = ReviewQueue(str(tmp_path / "queue.sqlite"))
  items = hh_items(40)
  items[0]["response_a"] += XSS  # model text is text, never markup
  fill(q, items)
  return q


@pytest.fixture
def servers(queue, tmp_path):
  started = []

  def start(port=None):
    started.append(Server(queue.path, str(tmp_path / "server.log"), port))
    return started[-1]
  yield start
  for s in started:
    s.stop(signal.SIGKILL)


def showing(page, item_id: str) -> None:
  expect(page.locator("body")).to_have_attribute("data-item-id", item_id)
  expect(page.locator("body")).to_have_attribute("data-busy", "")


def progress(page, resolved: int, mine: int, total: int = 40) -> None:
  expect(page.locator("#progress")).to_have_text(f"{resolved} / {total} resolved · yours: {mine}")


def test_label_undo_reload_persists(browser, queue, servers):
  server = servers()
  page = browser.new_context().new_page()
  page.goto(server.url + "/?reviewer=alice")
  showing(page, "hh-0000")
  progress(page, 0, 0)
  item = queue.get("hh-0000")
  assert page.locator("#prompt").text_content() == item["prompt"]
  assert page.locator("#response-a").text_content() == item["response_a"]  # literally, XSS too
  assert page.locator("#response-b").text_content() == item["response_b"]
  assert page.locator("#response-a img, #response-a script").count() == 0
  assert page.evaluate("window.__xss") is None

  page.click("#btn-A")  # a click ...
  showing(page, "hh-0001")
  page.keyboard.press("b")  # ... and keys
  showing(page, "hh-0002")
  page.keyboard.press("t")
  showing(page, "hh-0003")
  progress(page, 3, 3)
  page.click("#undo")
  showing(page, "hh-0002")
  progress(page, 2, 2)
  expect(page.locator("#message")).to_have_text("Undid tie on hh-0002.")

  page.reload()  # the state lives in the database, not the page
  showing(page, "hh-0002")
  progress(page, 2, 2)
  expect(page.locator("#who")).to_have_text("alice")
  assert {r["item_id"]: (r["label"], r["reviewer"]) for r in queue.resolved()} == {
      "hh-0000": ("A", "alice"), "hh-0001": ("B", "alice")}
  undone = queue.get("hh-0002")
  assert undone["label"] is None and undone["lease_reviewer"] == "alice"
  assert [(h["action"], h["label"]) for h in queue.history("hh-0002")] == [
      ("label", "tie"), ("undo", "tie")]

  page.keyboard.press("x")  # both bad, then Ctrl+Z takes it back
  showing(page, "hh-0003")
  page.keyboard.press("Control+z")
  showing(page, "hh-0002")
  page.keyboard.press("a")
  showing(page, "hh-0003")  # the item she held before the undo
  progress(page, 3, 3)
  assert [r["label"] for r in queue.resolved()] == ["A", "B", "A"]
  assert queue.check() == []


def test_two_reviewers_never_share_an_item(browser, queue, servers):
  server = servers()
  alice = browser.new_context().new_page()
  alice.goto(server.url + "/?reviewer=alice")
  bob = browser.new_context().new_page()  # no ?reviewer=: he types his name
  bob.goto(server.url + "/")
  expect(bob.locator("#name-form")).to_be_visible()
  bob.fill("#name-input", "bob")
  bob.click("#name-ok")
  showing(alice, "hh-0000")
  showing(bob, "hh-0001")
  seen = {"alice": ["hh-0000"], "bob": ["hh-0001"]}
  for step in range(4):  # both label at once: the two requests are in flight together
    alice.keyboard.press("ab"[step % 2])
    bob.click("#btn-tie" if step % 2 else "#btn-both_bad")
    for name, page in (("alice", alice), ("bob", bob)):
      expect(page.locator("body")).not_to_have_attribute("data-item-id", seen[name][-1])
      expect(page.locator("body")).to_have_attribute("data-busy", "")
      seen[name].append(page.locator("body").get_attribute("data-item-id"))
    assert seen["alice"][-1] != seen["bob"][-1]
  bob.reload()
  expect(bob.locator("#who")).to_have_text("bob")  # kept in localStorage
  showing(bob, seen["bob"][-1])

  # Meanwhile six API clients drain the rest of the queue concurrently.
  barrier, claims, errors = threading.Barrier(6), {}, []

  def reviewer(name):
    mine = claims.setdefault(name, [])
    try:
      barrier.wait()
      while (item := call(server.url, "/api/claim", {"reviewer": name})[1]["item"]):
        again = call(server.url, "/api/claim", {"reviewer": name})[1]["item"]
        assert again["item_id"] == item["item_id"], "a re-claim must return the held item"
        mine.append(item["item_id"])
        status, answer = call(server.url, "/api/submit",
                              {"reviewer": name, "item_id": item["item_id"], "label": "A"})
        assert status == 200, answer
    except Exception as e:  # noqa: BLE001 -- reported below
      errors.append(f"{name}: {e!r}")
  threads = [threading.Thread(target=reviewer, args=(f"api-{k}",)) for k in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not errors, errors
  held = {"alice": seen["alice"][-1], "bob": seen["bob"][-1]}
  labelled = {name: ids[:-1] for name, ids in seen.items()} | claims
  everything = [i for ids in labelled.values() for i in ids] + list(held.values())
  assert len(everything) == len(set(everything)) == 40  # disjoint, and every item served
  assert sum(len(ids) > 0 for ids in claims.values()) >= 2
  by_item = {r["item_id"]: r["reviewer"] for r in queue.resolved()}
  assert by_item == {i: name for name, ids in labelled.items() for i in ids}
  assert queue.check() == []


def test_resolved_item_is_refused_with_409(browser, queue, servers):
  server = servers()
  status, first = call(server.url, "/api/claim", {"reviewer": "alice"})
  assert status == 200 and first["item"]["item_id"] == "hh-0000"
  assert "teacher" not in first["item"]  # reviewers judge blind
  status, _ = call(server.url, "/api/submit", {"reviewer": "alice", "item_id": "hh-0000",
                                               "label": "A"})
  assert status == 200
  before = snapshot(queue.path)
  for who, label in (("alice", "B"), ("bob", "A")):
    status, answer = call(server.url, "/api/submit",
                          {"reviewer": who, "item_id": "hh-0000", "label": label})
    assert status == 409, answer
    assert "hh-0000 is already resolved ('A' by alice)" in answer["error"]
  assert call(server.url, "/api/submit", {"reviewer": "bob", "item_id": "nope",
                                          "label": "A"})[0] == 404
  assert call(server.url, "/api/submit", {"reviewer": "bob", "item_id": "hh-0005",
                                          "label": "C"})[0] == 400
  assert call(server.url, "/api/claim", {})[0] == 400  # no reviewer
  # a cross-site form post (text/plain needs no CORS preflight) is refused
  forged = urllib.request.Request(
      server.url + "/api/submit", headers={"Content-Type": "text/plain"},
      data=json.dumps({"reviewer": "bob", "item_id": "hh-0005", "label": "A"}).encode())
  with pytest.raises(urllib.error.HTTPError) as refused:
    urllib.request.urlopen(forged, timeout=30)
  assert refused.value.code == 415
  assert snapshot(queue.path) == before

  page = browser.new_context().new_page()  # alice's page; her other tab resolves the item
  page.goto(server.url + "/?reviewer=alice")
  showing(page, "hh-0001")
  queue.submit("hh-0001", "alice", "tie")
  page.keyboard.press("a")
  expect(page.locator("#message")).to_contain_text("hh-0001 is already resolved ('tie' by "
                                                   "alice); the label 'A' was not recorded")
  expect(page.locator("#message")).to_have_class("error")
  showing(page, "hh-0002")  # and she moves on
  progress(page, 2, 2)
  assert queue.get("hh-0001")["label"] == "tie" and queue.check() == []


def test_sigkilled_server_restarts_with_its_state(browser, queue, servers):
  server = servers()
  page = browser.new_context().new_page()
  page.goto(server.url + "/?reviewer=alice")
  showing(page, "hh-0000")
  page.keyboard.press("a")
  showing(page, "hh-0001")
  page.click("#btn-B")
  showing(page, "hh-0002")
  ok, stop = [], threading.Event()

  def bob():  # keeps labelling until the server dies under him
    while not stop.is_set():
      try:
        item = call(server.url, "/api/claim", {"reviewer": "bob"})[1]["item"]
        status, _ = call(server.url, "/api/submit", {"reviewer": "bob",
                                                     "item_id": item["item_id"], "label": "B"})
        ok.append(status == 200)
      except (OSError, http.client.HTTPException):
        return
  worker = threading.Thread(target=bob)
  worker.start()
  deadline = time.time() + 30
  while len(ok) < 5:
    assert worker.is_alive() and time.time() < deadline, "bob's client stopped early"
    time.sleep(0.01)
  server.stop(signal.SIGKILL)  # mid-use: bob's requests are in flight
  worker.join(timeout=30)
  stop.set()
  assert all(ok) and not worker.is_alive()
  page.keyboard.press("t")  # the page says the server is gone and keeps its item
  expect(page.locator("#message")).to_have_class("error")
  showing(page, "hh-0002")

  assert queue.check() == []
  restarted = servers(port=server.port)  # same database, same port: the page carries on
  page.reload()
  showing(page, "hh-0002")
  bob_done = queue.progress("bob")["mine"]
  assert bob_done in (len(ok), len(ok) + 1)  # +1: committed, answer lost in the kill
  progress(page, 2 + bob_done, 2)
  page.keyboard.press("t")
  expect(page.locator("body")).not_to_have_attribute("data-item-id", "hh-0002")
  progress(page, 3 + bob_done, 3)
  assert call(restarted.url, "/api/progress?reviewer=alice")[1]["mine"] == 3
  assert queue.check() == []


def test_cli_export_report_and_errors(queue, tmp_path, capsys):
  from train.assets import read_asset
  from cli.review import main
  queue.submit(queue.claim("alice")["item_id"], "alice", "B")
  main(["--db", queue.path, "--export", str(tmp_path / "assets")])
  summary = json.loads(capsys.readouterr().out)
  assert summary["resolved"] == 1 and summary["asset"].endswith("review_results/v1")
  assert [r["label"] for r in read_asset(summary["asset"])] == ["B"]
  main(["--db", queue.path, "--report"])
  assert json.loads(capsys.readouterr().out)["human_labels"]["B"] == 1
  with pytest.raises(SystemExit, match="missing required flag --db"):
    main([])
  with pytest.raises(SystemExit, match="nowhere/q.sqlite does not exist .--create makes"):
    main(["--db", str(tmp_path / "nowhere" / "q.sqlite")])  # a typo opens no empty queue
  with pytest.raises(SystemExit, match="directory .* does not exist"):
    main(["--db", str(tmp_path / "nowhere" / "q.sqlite"), "--create"])
  (tmp_path / "junk.sqlite").write_text("junk " * 200)
  with pytest.raises(SystemExit, match="not a usable SQLite database"):
    main(["--db", str(tmp_path / "junk.sqlite")])
