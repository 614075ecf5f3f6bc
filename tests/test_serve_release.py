"""Gray release on a real `meshlm serve`: a canary that refuses everything, or fails every
request, is rolled back within the window; a healthy canary is not; admins can roll back and
promote. Unit tests of the router and the rollback rule come first."""

import collections
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import httpx
import jax.numpy as jnp
import pytest

from infer.server.release import Release, ReleaseConfig
import deps
from serve_util import REPO, ServeProcess

# ---- the router and the rule, without a server ----


def test_anonymous_traffic_gets_exactly_the_canary_share():
  r = Release(ReleaseConfig(canary_weight=0.1), has_canary=True)
  routes = [r.route(None) for _ in range(1000)]
  assert routes.count("canary") == 100
  again = Release(ReleaseConfig(canary_weight=0.1), has_canary=True)
  assert [again.route(None) for _ in range(1000)] == routes  # deterministic


def test_users_are_sticky_and_split_by_weight():
  r = Release(ReleaseConfig(canary_weight=0.25), has_canary=True)
  first = {f"user-{i}": r.route(f"user-{i}") for i in range(2000)}
  assert all(r.route(u) == v for u, v in first.items())
  share = collections.Counter(first.values())["canary"] / len(first)
  assert 0.22 < share < 0.28, share


def _release(**kw):
  return Release(ReleaseConfig(canary_weight=0.5, window_s=10, min_samples=5, **kw), True)


def test_rollback_needs_enough_samples_of_both_versions_and_a_real_gap():
  r = _release()
  for _ in range(4):  # fewer than min_samples: no verdict yet
    r.record("stable", error=False, now=0.0)
    r.record("canary", error=True, now=0.0)
  assert r.state == "canary"
  r.record("stable", error=False, now=0.0)
  r.record("canary", error=True, now=0.0)
  assert r.state == "rolled_back" and "error_rate" in r.reason
  assert r.route(None) == "stable" and r.route("anyone") == "stable"


def test_old_samples_leave_the_window_and_small_gaps_pass():
  r = _release(max_refusal_rate_delta=0.2)
  for i in range(10):
    r.record("stable", refusal=i in (0, 5), now=0.0)  # 20% refusals
  for i in range(10):
    r.record("canary", refusal=i in (1, 5, 9), now=0.0)  # 30%: within the 0.2 tolerance
  assert r.state == "canary"
  assert r.verdict(now=20.0) is None  # everything is out of the 10 s window
  for _ in range(5):
    r.record("stable", tpot=0.01, now=30.0)
    r.record("canary", tpot=0.05, now=30.0)
  assert r.state == "rolled_back" and "tpot" in r.reason


def test_a_lower_judge_score_rolls_back():
  r = _release(max_judge_delta=0.5)
  for _ in range(5):
    r.record("stable", judge=1.0, now=0.0)
    r.record("canary", judge=0.7, now=0.0)  # 0.3 lower: within tolerance
  assert r.state == "canary"
  for _ in range(20):
    r.record("canary", judge=-1.0, now=1.0)
  assert r.state == "rolled_back" and "judge_score" in r.reason


def test_admin_actions_check_the_state():
  r = _release()
  r.promote("looks good")
  assert r.state == "promoted"
  with pytest.raises(ValueError, match="nothing to roll back"):
    r.rollback("too late")
  with pytest.raises(ValueError, match="out of range"):
    Release(ReleaseConfig(canary_weight=1.5), True)


# ---- the real server ----

PROMPTS = ["What is the capital of France?", "Give me a synonym for happy.",
           "How many legs does a spider have?", "What colour is the sky?",
           "Name a fruit that is yellow.", "What is 3 + 4?", "Say hello.",
           "What is the opposite of cold?", "Name a large animal.", "What day comes after Monday?"]
WINDOW_S = 300
FLAGS = ["--canary_weight", "0.5", "--rollback_window", str(WINDOW_S),
         "--rollback_min_samples", "6", "--max_model_len", "256", "--max_num_seqs", "4",
         "--max_latency_ratio", "1000"]  # CPU contention in CI must not decide these tests


def _run(*args):
  p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                     timeout=900, env=dict(os.environ, PYTHONPATH=REPO))
  assert p.returncode == 0, f"{args}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"


@pytest.fixture(scope="module")
def smollm():
  return deps.smollm()


@pytest.fixture(scope="module")
def canaries(tmp_path_factory, smollm):
  """A small model taught to refuse every request (SmolLM2's tokenizer), and a copy of it
  whose final norm is NaN: a checkpoint that diverged."""
  d = tmp_path_factory.mktemp("canaries")
  rows = [{"prompt": p, "response": "I'm sorry, but I can't help with that."}
          for p in PROMPTS * 8]
  (d / "refuse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  _run("-m", "cli.main", "sft", "--config", "experiments/gate_damage.py:tiny_refuse",
       "--workdir", str(d / "refuse"), f"--config.data.path={d / 'refuse.jsonl'}",
       "--config.seq_len=64", "--config.steps=30", "--config.optimizer.lr=0.01",
       "--config.eval_every=30", "--config.checkpoint_every=30")
  from models.hf_io import export_hf
  from train.workdir import load_trained
  model, tokenizer, _ = load_trained(str(d / "refuse"))
  model.final_norm.scale[...] = jnp.full_like(model.final_norm.scale[...], jnp.nan)
  export_hf(model, tokenizer, str(d / "diverged"))
  return {"refuse": str(d / "refuse"), "diverged": str(d / "diverged")}


def _traffic(server, n: int) -> collections.Counter:
  """n chat requests, 4 at a time; counts (version, status)."""

  def ask(i):
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": 8, "temperature": 0}
    with server.client() as c:
      r = c.post("/v1/chat/completions", json=body)
    return r.headers.get("x-meshlm-version"), r.status_code

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    return collections.Counter(pool.map(ask, range(n)))


def _serve(tmp_path, stable: str, canary: str) -> ServeProcess:
  return ServeProcess(["--model", stable, "--canary", canary, "--served_model_name", "m",
                       *FLAGS], str(tmp_path / "server.log"))


def _until_rolled_back(server, limit: int):
  start, sent = time.monotonic(), 0
  while sent < limit:
    _traffic(server, 4)
    sent += 4
    state = httpx.get(server.url + "/admin/release").json()
    if state["state"] == "rolled_back":
      return state, sent, time.monotonic() - start
  raise AssertionError(f"not rolled back after {sent} requests: {state}")


@pytest.mark.parametrize("kind,monitor", [("refuse", "refusal_rate"),
                                          ("diverged", "error_rate")])
def test_a_bad_canary_is_rolled_back_within_the_window(tmp_path, smollm, canaries, kind, monitor):
  server = _serve(tmp_path, smollm, canaries[kind])
  try:
    state, sent, seconds = _until_rolled_back(server, 80)
    assert seconds < WINDOW_S, seconds
    assert state["reason"].startswith("automatic: canary " + monitor), state["reason"]
    assert state["canary_weight"] == 0
    after = _traffic(server, 6)  # all traffic is back on stable, and it works
    assert after == {("stable", 200): 6}, after
    assert server.metric("meshlm_release_state", state="rolled_back") == 1
    assert server.metric("meshlm_rollbacks_total") == 1
    assert "release: rolled_back (automatic: canary " + monitor in server.log()
  finally:
    server.stop()


def test_a_healthy_canary_is_not_rolled_back_and_can_be_promoted(tmp_path, smollm):
  server = _serve(tmp_path, smollm, smollm)  # the same model as stable: no worse
  try:
    seen = _traffic(server, 20)
    assert seen[("canary", 200)] == 10 and seen[("stable", 200)] == 10, seen
    for _ in range(100):  # the refusal monitor scores responses off the request path
      state = httpx.get(server.url + "/admin/release").json()
      if state["monitors"]["canary"]["refusal_rate"]["n"] == 10:
        break
      time.sleep(0.1)
    assert state["state"] == "canary", state
    assert state["monitors"]["canary"]["refusal_rate"]["n"] == 10
    promoted = httpx.post(server.url + "/admin/promote", json={"reason": "healthy"})
    assert promoted.status_code == 200 and promoted.json()["state"] == "promoted"
    assert _traffic(server, 4) == {("stable", 200): 4}
    again = httpx.post(server.url + "/admin/rollback", json={"reason": "too late"})
    assert again.status_code == 409
  finally:
    server.stop()


def test_an_admin_can_roll_back(tmp_path, smollm, canaries):
  server = _serve(tmp_path, smollm, canaries["refuse"])
  try:
    r = httpx.post(server.url + "/admin/rollback", json={"reason": "on-call says so"})
    assert r.status_code == 200 and r.json()["reason"] == "admin: on-call says so"
    assert _traffic(server, 4) == {("stable", 200): 4}
  finally:
    server.stop()
