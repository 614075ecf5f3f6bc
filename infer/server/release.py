"""Gray release: a weighted, sticky router, per-version online monitors, automatic rollback.

Routing is deterministic. A request with a user id goes to the canary when a
hash of (salt, user) falls below the canary weight, so a user always sees the
same version. Anonymous requests are spread by a counter: request i goes to the
canary when floor((i + 1) w) > floor(i w), exactly a share w of them.

Each version keeps sliding windows (the last `window_s` seconds) of: errors (a
failed generation, not a client's bad request), time per output token after the first,
refusals of sampled responses (the harmlessness refusal classifier,
align/evals/refusal.py) and, with a judge, reward-model scores. When both versions
have `min_samples` in a window and the canary is worse than stable by more than a
threshold, all traffic returns to stable: state "rolled_back", with the reason
logged and exposed (/admin/release, /metrics). Rollback and promotion can also be
asked for through the admin endpoints.
"""

import collections
import dataclasses
import hashlib
import logging
import math
import threading
import time

log = logging.getLogger("meshlm.serve")

MONITORS = ("error_rate", "tpot_s", "refusal_rate", "judge_score")


@dataclasses.dataclass
class ReleaseConfig:
  canary_weight: float = 0.1
  window_s: float = 60.0            # the monitors' sliding window
  min_samples: int = 20             # per version and monitor, in the window, before judging
  max_error_rate_delta: float = 0.05
  max_refusal_rate_delta: float = 0.2
  max_latency_ratio: float = 3.0    # canary time per output token / stable's
  max_judge_delta: float = 0.5      # stable's mean reward - canary's
  refusal_sample_rate: float = 1.0  # share of responses scored by the refusal classifier
  judge_sample_rate: float = 0.1
  salt: str = "meshlm"

  def validate(self) -> None:
    checks = [("canary_weight", 0 <= self.canary_weight <= 1),
              ("window_s", self.window_s > 0), ("min_samples", self.min_samples >= 1),
              ("max_error_rate_delta", 0 <= self.max_error_rate_delta <= 1),
              ("max_refusal_rate_delta", 0 <= self.max_refusal_rate_delta <= 1),
              ("max_latency_ratio", self.max_latency_ratio >= 1),
              ("max_judge_delta", self.max_judge_delta >= 0),
              ("refusal_sample_rate", 0 <= self.refusal_sample_rate <= 1),
              ("judge_sample_rate", 0 <= self.judge_sample_rate <= 1)]
    for name, ok in checks:
      if not ok:
        raise ValueError(f"release setting {name}={getattr(self, name)!r} is out of range")


class Window:
  """(time, value) samples of the last `seconds`."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.samples: collections.deque[tuple[float, float]] = collections.deque()

  def add(self, value: float, now: float | None = None) -> None:
    now = time.monotonic() if now is None else now
    self.samples.append((now, float(value)))
    self._trim(now)  # bounded memory whether or not anyone reads the window

  def _trim(self, now: float) -> None:
    while self.samples and self.samples[0][0] < now - self.seconds:
      self.samples.popleft()

  def stats(self, now: float | None = None) -> tuple[int, float]:
    """(count, mean) over the window; mean is NaN when empty."""
    self._trim(time.monotonic() if now is None else now)
    n = len(self.samples)
    return n, (sum(v for _, v in self.samples) / n if n else math.nan)


class Monitor:
  """One version's windows."""

  def __init__(self, seconds: float):
    self.windows = {name: Window(seconds) for name in MONITORS}

  def add(self, name: str, value: float, now: float | None = None) -> None:
    self.windows[name].add(value, now)

  def snapshot(self, now: float | None = None) -> dict:
    out = {}
    for name, w in self.windows.items():
      n, mean = w.stats(now)
      out[name] = {"n": n, "value": mean}
    return out


def unit_hash(salt: str, key: str) -> float:
  """A uniform number in [0, 1) from sha256(salt:key)."""
  digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2 ** 64


class Release:
  """Router, monitors and the rollback policy; thread-safe. See the module docstring."""

  def __init__(self, config: ReleaseConfig, has_canary: bool):
    config.validate()
    self.config = config
    self.state = "canary" if has_canary else "stable"
    self.weight = config.canary_weight if has_canary else 0.0
    self.reason: str | None = None
    self.changed_at = time.time()
    self.history: list[dict] = []
    self.monitors = {"stable": Monitor(config.window_s), "canary": Monitor(config.window_s)}
    self._count = 0
    self._lock = threading.Lock()
    self.on_change = None  # called with the new state (the server counts rollbacks)

  # ---- routing ----

  def route(self, user: str | None) -> str:
    with self._lock:
      w = self.weight
      if w <= 0:
        return "stable"
      if user:
        return "canary" if unit_hash(self.config.salt, user) < w else "stable"
      i = self._count
      self._count += 1
      return "canary" if math.floor((i + 1) * w) > math.floor(i * w) else "stable"

  # ---- monitoring ----

  def record(self, role: str, *, error: bool | None = None, tpot: float | None = None,
             refusal: bool | None = None, judge: float | None = None,
             now: float | None = None) -> None:
    with self._lock:
      m = self.monitors[role]
      for name, value in (("error_rate", error), ("tpot_s", tpot),
                          ("refusal_rate", refusal), ("judge_score", judge)):
        if value is not None:
          m.add(name, float(value), now)
      if self.state == "canary":
        self._check(now)

  def verdict(self, now: float | None = None) -> str | None:
    """Why the canary should be rolled back now, or None."""
    cfg = self.config
    stable = self.monitors["stable"].snapshot(now)
    canary = self.monitors["canary"].snapshot(now)
    enough = lambda name: min(stable[name]["n"], canary[name]["n"]) >= cfg.min_samples
    value = lambda snap, name: snap[name]["value"]
    rules = [
        ("error_rate", lambda s, k: k - s > cfg.max_error_rate_delta,
         f"exceeds stable's by more than {cfg.max_error_rate_delta}"),
        ("refusal_rate", lambda s, k: k - s > cfg.max_refusal_rate_delta,
         f"exceeds stable's by more than {cfg.max_refusal_rate_delta}"),
        ("tpot_s", lambda s, k: k > cfg.max_latency_ratio * s,
         f"is more than {cfg.max_latency_ratio}x stable's"),
        ("judge_score", lambda s, k: s - k > cfg.max_judge_delta,
         f"is below stable's by more than {cfg.max_judge_delta}"),
    ]
    for name, worse, what in rules:
      if enough(name) and worse(value(stable, name), value(canary, name)):
        return (f"canary {name} {value(canary, name):.4g} {what} ({value(stable, name):.4g}; "
                f"n={canary[name]['n']} canary, {stable[name]['n']} stable, last "
                f"{cfg.window_s:g}s)")
    return None

  def _check(self, now) -> None:
    reason = self.verdict(now)
    if reason is not None:
      self._set("rolled_back", 0.0, "automatic: " + reason)

  # ---- state changes ----

  def _set(self, state: str, weight: float, reason: str) -> None:
    self.state, self.weight, self.reason = state, weight, reason
    self.changed_at = time.time()
    self.history.append({"time": self.changed_at, "state": state, "reason": reason})
    log.warning("release: %s (%s)", state, reason)
    if self.on_change is not None:
      self.on_change(state)

  def rollback(self, reason: str) -> None:
    with self._lock:
      if self.state != "canary":
        raise ValueError(f"nothing to roll back: the release is {self.state!r}")
      self._set("rolled_back", 0.0, "admin: " + reason)

  def promote(self, reason: str) -> None:
    """Marks the canary as the new stable; the caller swaps the workers."""
    with self._lock:
      if self.state != "canary":
        raise ValueError(f"nothing to promote: the release is {self.state!r}")
      self._set("promoted", 0.0, "admin: " + reason)
      self.monitors = {"stable": self.monitors["canary"], "canary": Monitor(self.config.window_s)}

  def set_weight(self, weight: float) -> None:
    with self._lock:
      if self.state != "canary":
        raise ValueError(f"no canary to weigh: the release is {self.state!r}")
      if not 0 <= weight <= 1:
        raise ValueError(f"canary weight {weight!r} must be in [0, 1]")
      self.weight = weight

  def describe(self) -> dict:
    with self._lock:
      return {"state": self.state, "canary_weight": self.weight, "reason": self.reason,
              "changed_at": self.changed_at, "history": list(self.history),
              "config": dataclasses.asdict(self.config),
              "monitors": {role: m.snapshot() for role, m in self.monitors.items()}}
