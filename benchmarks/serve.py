"""Load benchmark of `meshlm serve` in the format of vLLM's benchmarks/benchmark_serving.py.

    python benchmarks/serve.py --json [--model PATH] [--url URL] [--clients 32] [--duration 60]
        [--max-tokens 64] [--port P] [--chat] [--max-num-seqs N] [--max-model-len L]

Without --url the server is started here (`python -m cli.main serve`, repo root as cwd),
waited for on /health, warmed up with one request per client (compilation stays out of the
timed run) and stopped at the end. --clients closed-loop streaming clients each send a request,
read its stream to the end and send the next, for --duration seconds; requests in flight then
are finished and counted. Prompts: AlpacaEval instructions (data/alpaca-eval) in a seeded
order; every request asks for exactly --max-tokens tokens (ignore_eos) at temperature 0. The
server's RSS (children included) is sampled every 0.5 s. Metrics follow vLLM: TTFT to the
first chunk with text, ITL the gaps between text chunks, TPOT (latency - TTFT) / (output
tokens - 1). Exits 1 if any request failed or was lost.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_count, log  # noqa: E402
from train.report_paths import scrub_paths  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPACA = os.path.join(REPO, "data", "alpaca-eval", "text_davinci_003_model_outputs.json")
FLAT_THRESHOLD_PCT = 5.0
PEER = ("vLLM's benchmarks/benchmark_serving.py is the reference: the metric names and "
        "definitions here follow it. vLLM itself was not run: it is not installed on this "
        "CPU-only box (its PyPI wheels target CUDA GPUs; its CPU backend is built from source), "
        "so no vLLM numbers are given rather than invented ones.")


def load_prompts(seed: int = 0, max_chars: int = 600) -> list[str]:
  """AlpacaEval instructions short enough for a small context, in a seeded order."""
  with open(ALPACA) as f:
    texts = [r["instruction"] for r in json.load(f) if len(r["instruction"]) <= max_chars]
  return [texts[i] for i in np.random.default_rng(seed).permutation(len(texts))]


class SSEDecoder:
  """Server-sent events line by line: feed() returns an event's data when a blank line ends it."""

  def __init__(self):
    self.data = []

  def feed(self, line: str):
    if line == "":
      out, self.data = ("\n".join(self.data) if self.data else None), []
      return out
    if line.startswith("data:"):
      self.data.append(line[5:][1:] if line[5:6] == " " else line[5:])
    return None  # comments (":...") and other fields (event, id, retry) carry no chunk


@dataclass
class Result:
  """One request as the client saw it; times in seconds from sending it."""
  ttft: float | None = None
  itl: list = field(default_factory=list)
  last: float | None = None
  chunks: int = 0
  usage: dict | None = None
  finish_reason: str | None = None
  done: bool = False
  error: str | None = None
  ok: bool = False
  output_tokens: int = 0
  prompt_tokens: int | None = None


def on_event(r: Result, data: str, t: float):
  """Folds one SSE data payload received at time t into r."""
  if r.error:
    return
  if r.done:
    r.error = f"data after [DONE]: {data[:100]!r}"
  elif data.strip() == "[DONE]":
    r.done = True
  else:
    try:
      chunk = json.loads(data)
    except ValueError:
      r.error = f"malformed chunk: {data[:100]!r}"
      return
    if not isinstance(chunk, dict) or "error" in chunk:
      r.error = f"error event: {data[:200]}"
      return
    r.usage = chunk.get("usage") or r.usage
    for c in chunk.get("choices") or []:
      text = c["text"] if "text" in c else (c.get("delta") or {}).get("content")
      r.finish_reason = c.get("finish_reason") or r.finish_reason
      if text:  # role-only and usage-only chunks carry no token
        r.chunks += 1
        if r.ttft is None:
          r.ttft = t
        else:
          r.itl.append(t - r.last)
        r.last = t


def finish(r: Result) -> Result:
  """Decides ok/failed once the stream has ended; tokens from usage, else text chunks."""
  if r.error is None and not r.done:
    r.error = "stream ended without [DONE]"
  if r.error is None and r.ttft is None:
    r.error = "no text in the stream"
  r.ok = r.error is None
  r.output_tokens = int((r.usage or {}).get("completion_tokens") or r.chunks)
  r.prompt_tokens = (r.usage or {}).get("prompt_tokens")
  return r


async def one_request(http, url: str, payload: dict) -> Result:
  r, t0 = Result(), time.perf_counter()
  try:
    async with http.stream("POST", url, json=payload) as resp:
      if resp.status_code != 200:
        body = (await resp.aread())[:200]
        r.error = f"HTTP {resp.status_code}: {body.decode(errors='replace')}"
        return finish(r)
      dec = SSEDecoder()
      async for line in resp.aiter_lines():
        data = dec.feed(line)
        if data is not None:
          on_event(r, data, time.perf_counter() - t0)
      if (data := dec.feed("")) is not None:  # a last event without its blank line
        on_event(r, data, time.perf_counter() - t0)
  except Exception as e:  # a broken stream or a timeout is a failed request, not a crash
    r.error = r.error or f"{type(e).__name__}: {e}"
  return finish(r)


def dist(xs, scale: float = 1000.0) -> dict:
  """mean/median/std/p99 as vLLM reports them (numpy's linear percentiles), in ms."""
  if len(xs) == 0:
    return {"mean": None, "median": None, "std": None, "p99": None}
  a = np.asarray(xs, np.float64) * scale
  return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
          "p99": float(np.percentile(a, 99))}


def summarize(results: list, sent: int, duration: float) -> dict:
  """vLLM's serving metrics over the completed requests, plus sent/completed/failed/lost."""
  good = [r for r in results if r.ok]
  failed = [r for r in results if not r.ok]
  out_tok = sum(r.output_tokens for r in good)
  in_tok = sum(r.prompt_tokens or 0 for r in good)
  out = {"sent": sent, "completed": len(good), "failed": len(failed),
         "lost": sent - len(good) - len(failed), "duration": duration,
         "total_input_tokens": in_tok, "total_output_tokens": out_tok,
         "request_throughput": len(good) / duration, "output_throughput": out_tok / duration,
         "total_token_throughput": (in_tok + out_tok) / duration}
  # Latency ends at the last text chunk (as in vLLM), so TPOT averages the decode gaps.
  tpot = [(r.last - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
  for name, xs in (("ttft", [r.ttft for r in good]), ("tpot", tpot),
                   ("itl", [x for r in good for x in r.itl]), ("e2el", [r.last for r in good])):
    for stat, v in dist(xs).items():
      out[f"{stat}_{name}_ms"] = v
  errors = {}
  for r in failed:
    errors[r.error] = errors.get(r.error, 0) + 1
  out["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
  out["finish_reasons"] = {k: sum(r.finish_reason == k for r in good)
                           for k in sorted({str(r.finish_reason) for r in good})}
  return out


def memory_summary(samples: list, window_s: float = 10.0) -> dict:
  """Mean RSS over the first and last window_s of (t, bytes) samples; flat if growth < 5%."""
  if not samples:
    return {"sampled": False, "reason": "no server pid (--url without --server-pid) or it died"}
  end = samples[-1][0]
  first = [b for t, b in samples if t <= samples[0][0] + window_s]
  last = [b for t, b in samples if t >= end - window_s]
  f, l = np.mean(first) / 2**20, np.mean(last) / 2**20
  return {"sampled": True, "samples": len(samples), "interval_s": 0.5, "window_s": window_s,
          "first_window_mean_mib": float(f), "last_window_mean_mib": float(l),
          "peak_mib": max(b for _, b in samples) / 2**20, "growth_mib": float(l - f),
          "growth_pct": float(100 * (l - f) / f), "flat_threshold_pct": FLAT_THRESHOLD_PCT,
          "memory_flat": bool(100 * (l - f) / f < FLAT_THRESHOLD_PCT)}


def parse_metrics(text: str, limit: int = 60) -> dict:
  """Prometheus text to {sample: value}; histogram buckets left out (too many to report)."""
  out = {}
  for line in text.splitlines():
    name, _, value = line.rpartition(" ")
    base = name.split("{")[0]
    if line.startswith("#") or not base or base.endswith(("_bucket", "_created")):
      continue
    try:
      v = float(value)
    except ValueError:
      continue
    out[name.strip()] = v if np.isfinite(v) else None  # NaN/inf are not JSON
    if len(out) >= limit:
      break
  return out


def rss_bytes(proc) -> int:
  """RSS of a psutil process and all its children (workers count towards the server)."""
  total = 0
  for p in [proc] + proc.children(recursive=True):
    try:
      total += p.memory_info().rss
    except psutil.Error:  # a child exited between listing and reading
      pass
  return total


async def sample_memory(pid, samples: list, t0: float, stop_at: float):
  try:
    proc = psutil.Process(pid)
    while time.perf_counter() < stop_at:
      samples.append((time.perf_counter() - t0, rss_bytes(proc)))
      await asyncio.sleep(0.5)
  except psutil.Error:  # the server died: its failed requests say so, the samples stop here
    pass


async def run_load(http, url, make_payload, prompts, clients, deadline=None, per_client=None,
                   grace_s=600.0, offset=0):
  """(results, sent): closed-loop clients until the deadline (or per_client requests each).

  Requests still open grace_s after the deadline are cancelled: sent but never counted, lost."""
  results, sent = [], [0]

  async def client(i):
    k, n = offset + i, 0
    while (deadline is None or time.perf_counter() < deadline) and (
        per_client is None or n < per_client):
      sent[0] += 1
      results.append(await one_request(http, url, make_payload(prompts[k % len(prompts)])))
      k, n = k + clients, n + 1

  tasks = [asyncio.create_task(client(i)) for i in range(clients)]
  limit = None if deadline is None else deadline - time.perf_counter() + grace_s
  _, pending = await asyncio.wait(tasks, timeout=limit)
  for t in pending:
    t.cancel()
  return results, sent[0]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(args, log_path):
  cmd = [sys.executable, "-m", "cli.main", "serve", "--model", args.model, "--port",
         str(args.port)]
  for flag, v in (("--max_num_seqs", args.max_num_seqs or args.clients),
                  ("--max_model_len", args.max_model_len), ("--warmup", args.warmup)):
    cmd += [flag, str(v)] if v is not None else []
  log(f"serve: starting {' '.join(cmd)} (log {log_path})")
  env = dict(os.environ, **({"MESHLM_API_KEY": args.api_key} if args.api_key else {}))
  # The server's output goes to a file: stdout here holds only the JSON document.
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log_path, "w"),
                          stderr=subprocess.STDOUT)


def stop_server(proc):
  proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


async def wait_healthy(http, base, proc, timeout_s):
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < timeout_s:
    if proc is not None and proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode} before /health")
    try:
      if (await http.get(base + "/health", timeout=5)).status_code == 200:
        return time.perf_counter() - t0
    except httpx.TransportError:  # not listening yet
      pass
    await asyncio.sleep(1.0)
  raise RuntimeError(f"/health not ready after {timeout_s} s")


async def bench(args, base, proc) -> dict:
  headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
  limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
  async with httpx.AsyncClient(headers=headers, limits=limits,
                               timeout=httpx.Timeout(args.request_timeout)) as http:
    ready_s = await wait_healthy(http, base, proc, args.health_timeout)
    model_id = (await http.get(base + "/v1/models")).json()["data"][0]["id"]
    log(f"serve: ready after {ready_s:.1f} s, model {model_id!r}")
    url = base + ("/v1/chat/completions" if args.chat else "/v1/completions")
    common = {"model": model_id, "max_tokens": args.max_tokens, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}

    def make_payload(p):
      return dict(common, **({"messages": [{"role": "user", "content": p}]} if args.chat
                             else {"prompt": p}))

    prompts = load_prompts(args.seed, args.max_prompt_chars)
    t = time.perf_counter()  # warm-up prompts come from the far end: no prefix reuse later
    warm, warm_sent = await run_load(http, url, make_payload, prompts[::-1], args.clients,
                                     per_client=args.warmup_rounds)
    warm_s = time.perf_counter() - t
    log(f"serve: warm-up {warm_sent} requests in {warm_s:.1f} s, "
        f"{sum(not r.ok for r in warm)} failed")
    pid = proc.pid if proc is not None else args.server_pid
    samples, t0 = [], time.perf_counter()
    deadline = t0 + args.duration
    sampler = asyncio.create_task(sample_memory(pid, samples, t0, deadline)
                                  if pid else asyncio.sleep(0))
    results, sent = await run_load(http, url, make_payload, prompts, args.clients, deadline,
                                   grace_s=args.request_timeout)
    duration = time.perf_counter() - t0
    await sampler
    try:
      server_metrics = parse_metrics((await http.get(base + "/metrics")).text)
    except Exception as e:  # /metrics is a bonus, not a requirement
      server_metrics = {"error": f"{type(e).__name__}: {e}"}
  out = summarize(results, sent, duration)  # ignore_eos: fewer tokens would be a server bug
  out["short_outputs"] = sum(r.output_tokens < args.max_tokens for r in results if r.ok)
  return {
      "benchmark": "meshlm serve, closed-loop streaming clients (vLLM benchmark_serving format)",
      "config": {"clients": args.clients, "duration_s": args.duration,
                 "max_tokens": args.max_tokens, "model": args.model, "model_id": model_id,
                 "url": base, "endpoint": url[len(base):], "ignore_eos": True,
                 "temperature": 0.0, "max_num_seqs": args.max_num_seqs or args.clients,
                 "max_model_len": args.max_model_len, "seed": args.seed,
                 "prompts": f"AlpacaEval instructions <= {args.max_prompt_chars} chars",
                 "server_started_here": proc is not None, "cpu_count": cpu_count()},
      "server_ready_s": ready_s,
      "warmup": {k: w for k, w in summarize(warm, warm_sent, warm_s).items() if k in (
          "sent", "completed", "failed", "lost", "duration", "errors")},
      **out,
      "memory": memory_summary(samples, min(10.0, args.duration / 3)),
      "server_metrics": server_metrics,
      "peer": PEER,
  }


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
  parser.add_argument("--model", default=None, help="served model (default SmolLM2 GGUF)")
  parser.add_argument("--url", default=None, help="an already running server, http://HOST:PORT")
  parser.add_argument("--server-pid", type=int, default=None, help="sample this RSS with --url")
  parser.add_argument("--clients", type=int, default=32)
  parser.add_argument("--duration", type=float, default=60.0)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--port", type=int, default=None)
  parser.add_argument("--chat", action="store_true", help="/v1/chat/completions")
  parser.add_argument("--max-num-seqs", type=int, default=None, help="default: --clients")
  parser.add_argument("--max-model-len", type=int, default=512)
  parser.add_argument("--warmup", default="full", choices=["none", "basic", "full"],
                      help="the server's own warm-up (full: every step shape compiled)")
  parser.add_argument("--api-key", default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--warmup-rounds", type=int, default=1, help="requests per client")
  parser.add_argument("--max-prompt-chars", type=int, default=600)
  parser.add_argument("--health-timeout", type=float, default=600.0)
  parser.add_argument("--request-timeout", type=float, default=600.0)
  return parser


def run_one(args) -> dict:
  """One load run as the flags in `args` ask (a server started here unless --url); exits 2
  if the server fails to come up. The result's paths are scrubbed."""
  proc, base = None, args.url.rstrip("/") if args.url else None
  if base is None:
    from models.pretrained import smollm_path
    args.model = args.model or smollm_path()
    args.port = args.port or free_port()
    base = f"http://127.0.0.1:{args.port}"
    log_path = os.path.join(tempfile.mkdtemp(prefix="meshlm-serve-bench-"), "server.log")
    proc = start_server(args, log_path)
  try:
    result = asyncio.run(bench(args, base, proc))
  except RuntimeError as e:
    log(f"serve: {e}")
    if proc is not None:
      log("server log tail:\n" + open(log_path).read()[-3000:])
    sys.exit(2)
  finally:
    if proc is not None:
      stop_server(proc)
  result["server_log"] = log_path if proc is not None else None
  return scrub_paths(result)  # the model path, the log, the /metrics labels


def main():
  args = make_parser().parse_args()
  result = run_one(args)
  print(json.dumps(result, indent=None if args.json else 2))
  warm = result["warmup"]
  sys.exit(1 if result["failed"] + result["lost"] + warm["sent"] - warm["completed"] else 0)


if __name__ == "__main__":
  main()
