"""benchmarks/serve.py statistics against hand-computed numbers (no server)."""

import asyncio
import json
import time

import pytest

from benchmarks import serve
from benchmarks.serve import Result, SSEDecoder, dist, finish, memory_summary, on_event


def _stream(events, usage=True, done=True, chat=False):
  """A finished Result from (t, text) token chunks, as the server would stream them."""
  r = Result()
  if chat:
    on_event(r, json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 0.01)
  for t, text in events:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    on_event(r, json.dumps({"choices": [choice]}), t)
  if usage:
    on_event(r, json.dumps({"choices": [], "usage": {"prompt_tokens": 10,
                                                     "completion_tokens": len(events)}}), 9.0)
  if done:
    on_event(r, "[DONE]", 9.5)
  return finish(r)


def test_sse_decoder_joins_data_lines_and_skips_comments():
  dec = SSEDecoder()
  lines = [": keep-alive", "", "data: {\"a\": 1}", "", "data:[DONE]", "event: x", "",
           "data: one", "data: two", ""]
  assert [d for d in map(dec.feed, lines) if d is not None] == ['{"a": 1}', "[DONE]", "one\ntwo"]


def test_ttft_itl_tpot_and_latency_from_chunk_times():
  r = _stream([(0.5, "Hello"), (0.6, " there"), (0.8, ","), (0.9, " friend")], chat=True)
  assert r.ok and r.ttft == 0.5 and r.last == 0.9
  assert r.itl == pytest.approx([0.1, 0.2, 0.1])
  assert r.output_tokens == 4 and r.prompt_tokens == 10
  s = serve.summarize([r], sent=1, duration=2.0)
  assert s["mean_ttft_ms"] == pytest.approx(500)
  assert s["mean_tpot_ms"] == pytest.approx((0.9 - 0.5) / 3 * 1000)  # == mean ITL here
  assert s["mean_itl_ms"] == pytest.approx(400 / 3) and s["median_itl_ms"] == pytest.approx(100)
  assert s["mean_e2el_ms"] == pytest.approx(900)
  assert s["output_throughput"] == 2.0 and s["total_token_throughput"] == 7.0
  assert s["request_throughput"] == 0.5


def test_usage_beats_chunk_count_and_empty_chunks_are_not_tokens():
  r = Result()
  for t, text in ((0.2, ""), (0.3, "ab"), (0.5, "cd")):  # "" is not the first token
    on_event(r, json.dumps({"choices": [{"text": text}]}), t)
  on_event(r, json.dumps({"choices": [], "usage": {"completion_tokens": 5}}), 0.6)
  on_event(r, "[DONE]", 0.7)
  finish(r)
  assert r.ttft == 0.3 and r.output_tokens == 5 and r.chunks == 2
  assert serve.summarize([r], 1, 1.0)["mean_tpot_ms"] == pytest.approx(0.2 / 4 * 1000)
  assert _stream([(0.1, "a"), (0.2, "b")], usage=False).output_tokens == 2  # fallback


def test_percentiles_match_numpy_linear_interpolation():
  d = dist([0.001 * x for x in range(1, 101)])  # 1..100 ms
  assert d["mean"] == pytest.approx(50.5) and d["median"] == pytest.approx(50.5)
  assert d["p99"] == pytest.approx(99.01)  # 99 + 0.01 * (100 - 99)
  assert dist([0.002, 0.004])["std"] == pytest.approx(1.0)
  assert dist([])["mean"] is None


def test_failures_and_lost_counting():
  bad = [_stream([(0.1, "a")], done=False),
         finish(Result(error="HTTP 500: boom")),
         _stream([], usage=False)]
  r = Result()
  on_event(r, '{"error": {"message": "oops"}}', 0.1)
  bad.append(finish(r))
  r = Result()
  on_event(r, "{not json", 0.1)
  bad.append(finish(r))
  late = _stream([(0.1, "a")])
  on_event(late, '{"choices": [{"text": "b"}]}', 10.0)
  bad.append(finish(late))
  errors = [b.error for b in bad]
  assert not any(b.ok for b in bad)
  assert errors[0] == "stream ended without [DONE]" and errors[2] == "no text in the stream"
  assert errors[3].startswith("error event") and errors[4].startswith("malformed chunk")
  assert errors[5].startswith("data after [DONE]")
  good = [_stream([(0.1, "a"), (0.3, "b")]) for _ in range(3)]
  s = serve.summarize(good + bad, sent=11, duration=1.0)
  assert (s["sent"], s["completed"], s["failed"], s["lost"]) == (11, 3, 6, 2)
  assert s["total_output_tokens"] == 6 and s["mean_tpot_ms"] == pytest.approx(200)
  assert sum(s["errors"].values()) == 6


def test_memory_flat_threshold():
  mib = 2**20
  flat = [(0.5 * i, (1000 + (40 if i >= 80 else 0)) * mib) for i in range(120)]  # 0..59.5 s
  m = memory_summary(flat, 10.0)
  # first window t <= 10: 21 samples of 1000; last t >= 49.5: 21 samples of 1040
  assert m["first_window_mean_mib"] == 1000 and m["last_window_mean_mib"] == 1040
  assert m["growth_mib"] == 40 and m["growth_pct"] == pytest.approx(4.0) and m["memory_flat"]
  leak = [(0.5 * i, (1000 + i) * mib) for i in range(120)]
  m = memory_summary(leak, 10.0)
  assert m["first_window_mean_mib"] == 1010 and m["last_window_mean_mib"] == 1109
  assert m["growth_pct"] == pytest.approx(99 / 10.1) and not m["memory_flat"]
  assert m["flat_threshold_pct"] == 5.0 and memory_summary([])["sampled"] is False


def test_parse_metrics_skips_buckets_and_comments():
  text = ("# HELP req Requests.\n# TYPE req counter\nreq_total{code=\"200\"} 12\n"
          "lat_bucket{le=\"0.1\"} 3\nlat_sum 1.5\nlat_count 3\nbad line x\n"
          "req_created 1.7e9\nmon{k=\"a b\"} NaN\n\n")
  assert serve.parse_metrics(text) == {'req_total{code="200"}': 12.0, "lat_sum": 1.5,
                                       "lat_count": 3.0, 'mon{k="a b"}': None}


def test_prompts_are_seeded_and_short():
  a, b = serve.load_prompts(0, 300), serve.load_prompts(0, 300)
  assert a == b and a != serve.load_prompts(1, 300) and max(map(len, a)) <= 300 and len(a) > 500


def test_run_load_counts_cancelled_requests_as_lost(monkeypatch):
  async def slow(http, url, payload):
    await asyncio.sleep(0.05 if payload == "p0" else 10)
    return finish(Result(ttft=0.01, last=0.02, chunks=2, done=True))
  monkeypatch.setattr(serve, "one_request", slow)

  async def go():
    return await serve.run_load(None, "u", lambda p: p, ["p0", "p1"], clients=2,
                                deadline=time.perf_counter() + 0.5, grace_s=0.1)
  results, sent = asyncio.run(go())
  s = serve.summarize(results, sent, 1.0)
  # client 0 sends p0 again and again (0.05 s each) until the deadline, however many fit on a
  # loaded machine; client 1's p1 never returns and is cancelled after the grace period
  assert s["completed"] == sent - 1 and s["completed"] >= 2
  assert s["failed"] == 0 and s["lost"] == 1
