"""A real `meshlm serve` process for tests: started as a user starts it, on a free port."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServeProcess:
  """`python -m cli.main serve ARGS --port P`; its stderr goes to `log_path`."""

  def __init__(self, args: list[str], log_path: str, api_key: str | None = None,
               timeout: float = 600):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.api_key, self.log_path = api_key, log_path
    cmd = [sys.executable, "-m", "cli.main", "serve", *args, "--port", str(self.port)]
    env = dict(os.environ, PYTHONPATH=REPO)
    if api_key:
      env["MESHLM_API_KEY"] = api_key  # as a careful user passes it: not on the command line
    self._log = open(log_path, "w")
    self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log,
                                 stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"meshlm serve exited {self.proc.returncode}:\n{self.log()[-3000:]}")
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200:
          return
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    self.stop()
    raise AssertionError(f"meshlm serve did not become healthy:\n{self.log()[-3000:]}")

  @property
  def headers(self) -> dict:
    return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

  def client(self, **kw) -> httpx.Client:
    return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120),
                        **kw)

  def log(self) -> str:
    if not self._log.closed:
      self._log.flush()
    with open(self.log_path, errors="replace") as f:
      return f.read()

  def metric(self, name: str, **labels) -> float | None:
    """One sample of /metrics, or None if absent."""
    text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
      m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
      if m and m.group(1) == name:
        got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
        if got == want:
          return float(m.group(3))
    return None

  def stop(self) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()
    return self.proc.returncode
