"""`/metrics`: the server's Prometheus metrics (prometheus_client, one registry per server).

Counters and histograms are updated as requests finish; gauges (queue depth, KV
blocks, tokens/s, the release state and the online monitors) are read from the
workers and the Release when Prometheus scrapes.
"""

import collections
import threading
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infer.server.release import MONITORS

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40,
                    80, 160)
_STATES = ("stable", "canary", "rolled_back", "promoted")
prometheus_client.disable_created_metrics()  # *_created series only double the scrape


class ServerMetrics:
  """Every metric `meshlm serve` exports; docs/serving.md lists them."""

  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.requests = Counter("meshlm_requests", "HTTP requests by endpoint and status code",
                            ["endpoint", "status"], registry=r)
    self.errors = Counter("meshlm_request_errors", "Errors by kind: client (4xx), http_5xx "
                          "(5xx), generation (a failed generation, by version)",
                          ["kind", "version"], registry=r)
    self.generations = Counter("meshlm_generations", "Generation requests by model version",
                               ["version"], registry=r)
    self.prompt_tokens = Counter("meshlm_prompt_tokens", "Prompt tokens read", ["version"],
                                 registry=r)
    self.output_tokens = Counter("meshlm_generation_tokens", "Tokens generated", ["version"],
                                 registry=r)
    self.ttft = Histogram("meshlm_time_to_first_token_seconds", "Request arrival to first token",
                          ["version"], buckets=_LATENCY_BUCKETS, registry=r)
    self.tpot = Histogram("meshlm_time_per_output_token_seconds",
                          "Time per output token after the first", ["version"],
                          buckets=_LATENCY_BUCKETS, registry=r)
    self.latency = Histogram("meshlm_e2e_request_latency_seconds", "Request arrival to its end",
                             ["version"], buckets=_LATENCY_BUCKETS, registry=r)
    self.disconnects = Counter("meshlm_client_disconnects", "Requests whose client went away "
                               "before the end (their KV blocks freed)", ["version"], registry=r)
    self.rejected = Counter("meshlm_rejected_busy", "Requests refused with 429: too many in "
                            "flight", registry=r)
    self.in_flight = Gauge("meshlm_requests_in_flight", "Generation requests being served",
                           registry=r)
    self.queue_depth = Gauge("meshlm_queue_depth", "Requests waiting for a batch slot",
                             ["version"], registry=r)
    self.running = Gauge("meshlm_running_requests", "Requests in the running batch",
                         ["version"], registry=r)
    self.blocks_used = Gauge("meshlm_kv_blocks_used", "KV-cache blocks in use", ["version"],
                             registry=r)
    self.blocks_total = Gauge("meshlm_kv_blocks_total", "KV-cache blocks in the pool",
                              ["version"], registry=r)
    self.tokens_per_s = Gauge("meshlm_generation_tokens_per_second",
                              "Tokens generated per second over the last 10 s", ["version"],
                              registry=r)
    self.info = Gauge("meshlm_model_info", "The model path each version serves",
                      ["version", "path"], registry=r)
    self.weight = Gauge("meshlm_canary_weight", "Share of traffic routed to the canary",
                        registry=r)
    self.state = Gauge("meshlm_release_state", "1 for the release's current state", ["state"],
                       registry=r)
    self.rollbacks = Counter("meshlm_rollbacks", "Canary rollbacks (automatic or admin)",
                             registry=r)
    self.monitor = Gauge("meshlm_monitor_value", "Online monitor over the sliding window (NaN "
                         "when it has no samples)", ["version", "monitor"], registry=r)
    self.monitor_n = Gauge("meshlm_monitor_samples", "Samples in the monitor's window",
                           ["version", "monitor"], registry=r)
    self._recent: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    self._lock = threading.Lock()

  def generated(self, version: str, n: int) -> None:
    """Counts `n` new tokens (also for the tokens/s gauge)."""
    self.output_tokens.labels(version).inc(n)
    now = int(time.monotonic())
    with self._lock:  # per-second buckets of the last 10 s: bounded memory
      q = self._recent[version]
      if q and q[-1][0] == now:
        q[-1][1] += n
      else:
        q.append([now, n])
      self._trim(q, now)

  def _trim(self, q, now: float, seconds: int = 10) -> None:
    while q and q[0][0] <= now - seconds:
      q.popleft()

  def _rate(self, version: str, seconds: int = 10) -> float:
    with self._lock:
      q = self._recent[version]
      self._trim(q, int(time.monotonic()), seconds)
      return sum(n for _, n in q) / seconds

  def render(self, versions, release) -> bytes:
    """The exposition text, with the gauges read now."""
    for gauge in (self.info, self.queue_depth, self.running, self.blocks_used,
                  self.blocks_total, self.tokens_per_s):
      gauge.clear()  # a promoted canary's old labels must not linger
    for role, worker in versions.roles.items():
      s = worker.stats
      self.queue_depth.labels(role).set(s["waiting"] + worker.pending)
      self.running.labels(role).set(s["running"])
      self.blocks_used.labels(role).set(s["blocks_used"])
      self.blocks_total.labels(role).set(s["blocks_total"])
      self.tokens_per_s.labels(role).set(self._rate(role))
      self.info.labels(role, worker.path).set(1)
    d = release.describe()
    self.weight.set(d["canary_weight"])
    for state in _STATES:
      self.state.labels(state).set(1 if d["state"] == state else 0)
    for role, snap in d["monitors"].items():
      for name in MONITORS:
        self.monitor.labels(role, name).set(snap[name]["value"])
        self.monitor_n.labels(role, name).set(snap[name]["n"])
    return generate_latest(self.registry)
