"""Watchdog and PeerMonitor end the process with their exit statuses, in real subprocesses."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from train import exit_codes
from train.watchdog import PeerMonitor

WORKER = os.path.join(REPO, "tests", "workers", "peer_loss.py")
ENV = dict(os.environ, PYTHONPATH=REPO)
# Sleeps, timeouts and killed processes: run alone, after the parallel part (README).
pytestmark = pytest.mark.serial

# Steps of ~50 ms after a 1 s "compilation" step: the limit is max(0.5, 3 x 0.05) = 0.5 s.
STEPS = """
import sys, time
from train.watchdog import Watchdog

def stuck_in_collective():
  time.sleep(60)

wd = Watchdog(factor=3, min_seconds=0.5, log=sys.argv[2])
for step in range(30):
  wd.step_started(step)
  t = time.monotonic()
  time.sleep(1.0 if step == 0 else 0.05)  # step 0 compiles: longer than the limit, not armed
  if step == 10:
    with wd.paused():  # an evaluation inside the step is excluded
      time.sleep(1.0)
  if step == 20 and sys.argv[1] == "hang":
    print(f"hanging at {time.monotonic():.3f}", flush=True)
    stuck_in_collective()
  wd.step_finished(step, time.monotonic() - t if step != 10 else 0.05)
  if step == 15:
    time.sleep(1.0)  # between steps (a checkpoint): not watched
print("limit", wd.limit())
wd.close()
"""


def _run_steps(mode, tmp_path):
  log = str(tmp_path / "watchdog.log")
  proc = subprocess.run([sys.executable, "-c", STEPS, mode, log], env=ENV, cwd=REPO,
                        capture_output=True, text=True, timeout=30)
  with open(log) as f:
    return proc, f.read(), time.monotonic()


def test_watchdog_trips_on_a_hung_step(tmp_path):
  proc, log, ended = _run_steps("hang", tmp_path)
  assert proc.returncode == exit_codes.HUNG, proc.stdout + proc.stderr
  hung_at = float(proc.stdout.split("hanging at ")[1].split()[0])
  assert ended - hung_at < 0.5 + 1.5  # the limit, plus the check interval and process exit
  assert "meshlm watchdog: step 20 has run" in log, log
  assert "over its limit of 0.5 s" in log and "median step 0.05" in log, log
  assert "in stuck_in_collective" in log, log  # the main thread's stack, from faulthandler
  assert "meshlm watchdog: step 20" in proc.stderr  # also on stderr


def test_watchdog_quiet_on_normal_steps_pauses_and_gaps(tmp_path):
  proc, log, _ = _run_steps("normal", tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr + log
  assert "limit 0.5" in proc.stdout
  assert log == ""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _peer_loss(signum, timeout_s=6.0):
  """Starts 2 workers, sends `signum` to process 1 once both run collectives, and returns
  (process 0's exit status, its output, seconds from the signal to its exit)."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(i), str(timeout_s)],
                            env=ENV, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    out = []
    for line in procs[0].stdout:  # both are past initialize and in the collective loop
      out.append(line)
      if line.startswith("step 5 "):
        break
    assert out and out[-1].startswith("step 5 "), "".join(out)[-4000:]
    os.kill(procs[1].pid, signum)
    sent = time.monotonic()
    rest = procs[0].communicate(timeout=timeout_s + 15)[0]
    return procs[0].returncode, "".join(out) + rest, time.monotonic() - sent
  finally:
    for p in procs:
      p.kill()  # SIGKILL also ends a stopped process
      p.wait()


def test_peer_monitor_survivor_exits_when_peer_is_killed():
  """The killed peer's sockets close, so the all-gather fails at once; the survivor then
  waits in JAX's exit-time shutdown barrier, and the monitor ends it."""
  code, out, seconds = _peer_loss(signal.SIGKILL)
  assert code == exit_codes.PEER_LOST, out[-4000:]
  assert "lost peer process 1: no heartbeat for" in out, out[-4000:]
  assert seconds < 6.0 + 3.0, seconds  # timeout, poll and grace before process 0 exits


def test_peer_monitor_survivor_exits_when_blocked_in_a_collective():
  """A frozen peer (SIGSTOP: a hung host) keeps its sockets open: the survivor blocks
  inside the all-gather, and only the monitor's thread can end it."""
  code, out, seconds = _peer_loss(signal.SIGSTOP)
  assert code == exit_codes.PEER_LOST, out[-4000:]
  assert "lost peer process 1: no heartbeat for" in out, out[-4000:]
  assert "AllGather failed" not in out  # it was still blocked, not failed
  assert seconds < 6.0 + 3.0, seconds


def test_peer_monitor_quiet_when_peers_finish_normally():
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(i), "3", "10"], env=ENV,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    outs = [p.communicate(timeout=25)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
      p.wait()
  for p, out in zip(procs, outs):
    assert p.returncode == 0 and "done" in out and "lost" not in out, out[-4000:]


def test_peer_monitor_is_a_no_op_in_one_process():
  monitor = PeerMonitor(timeout_s=1, poll_s=1)
  assert not monitor.active
  monitor.close()
