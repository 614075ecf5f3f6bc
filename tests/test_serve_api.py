"""`meshlm serve` of SmolLM2-135M-Instruct, driven by the official `openai` client and httpx."""

import concurrent.futures
import time

import httpx
import openai
import pytest

import deps
from models.pretrained import load_pretrained_tokenizer
from serve_util import ServeProcess

SMOLLM = deps.smollm()
KEY = "sk-meshlm-test-0123456789abcdef"
MAX_CONCURRENT = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  log = tmp_path_factory.mktemp("serve") / "server.log"
  s = ServeProcess(["--model", SMOLLM, "--max_model_len", "256", "--max_num_seqs", "4",
                    "--max_concurrent", str(MAX_CONCURRENT), "--max_tokens", "200"],
                   str(log), api_key=KEY)
  yield s
  s.stop()  # SIGTERM: uvicorn shuts down gracefully, then re-raises the signal
  assert "Application shutdown complete" in s.log()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
  return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
  return load_pretrained_tokenizer(SMOLLM)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_completions_stream_equals_non_stream_and_usage_counts_are_right(client, model_id,
                                                                        tokenizer):
  prompt = "The capital of France is"
  full = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
  streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
  chunks = list(streamed)
  text = "".join(c.choices[0].text for c in chunks if c.choices)
  assert text == full.choices[0].text and text.strip()
  assert full.choices[0].finish_reason == "length"
  assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
  assert full.usage.completion_tokens == 12
  assert full.usage.total_tokens == full.usage.prompt_tokens + 12
  assert chunks[-1].usage.model_dump() == full.usage.model_dump()
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream_and_stops_at_eos(client, model_id, tokenizer):
  full = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=40,
                                        temperature=0, logprobs=True)
  stream = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=40,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  answer = full.choices[0].message.content
  assert text == answer and answer.strip()
  assert full.choices[0].finish_reason == "stop"  # SmolLM2 ends its turn well within 40
  rendered = tokenizer.apply_chat_template(MESSAGES)
  assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_bos=False))
  # one logprob per generated token, the end-of-turn token included
  assert full.usage.completion_tokens == len(full.choices[0].logprobs.content)
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_sampling_fields(client, model_id):
  kw = dict(model=model_id, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9)
  a = client.completions.create(seed=7, n=2, **kw)
  b = client.completions.create(seed=7, n=2, **kw)
  assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
  assert a.choices[0].text != a.choices[1].text  # n choices are different samples
  assert a.usage.completion_tokens == 16
  stop = client.completions.create(model=model_id, prompt="1, 2, 3, 4,", max_tokens=30,
                                   temperature=0, stop=[" 7"])
  assert stop.choices[0].finish_reason == "stop" and "7" not in stop.choices[0].text
  lp = client.completions.create(model=model_id, prompt="Hello", max_tokens=3, temperature=0,
                                 logprobs=2)
  info = lp.choices[0].logprobs
  assert len(info.tokens) == len(info.token_logprobs) == len(info.top_logprobs) == 3
  # greedy: the chosen token is the most likely one
  assert all(max(top.values()) == pytest.approx(chosen, abs=1e-5)
             for top, chosen in zip(info.top_logprobs, info.token_logprobs))


def test_models_health_and_auth(server):
  assert httpx.get(server.url + "/health").status_code == 200  # no key needed
  for path in ("/v1/models", "/metrics", "/admin/release"):
    assert httpx.get(server.url + path).status_code == 401
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}
                     ).status_code == 401
    assert httpx.get(server.url + path, headers=server.headers).status_code == 200


def _stream_until(server, model_id, n_chunks: int) -> None:
  """Starts a long stream, reads a few chunks, and drops the connection."""
  body = {"model": model_id, "prompt": "Count: 1, 2, 3,", "max_tokens": 200,
          "ignore_eos": True, "stream": True}
  with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200
    seen = 0
    for line in r.iter_lines():
      seen += line.startswith("data: ")
      if seen >= n_chunks:
        break


def test_client_disconnect_frees_kv_blocks(server, model_id):
  before = server.metric("meshlm_client_disconnects_total", version="stable") or 0
  tokens = server.metric("meshlm_generation_tokens_total", version="stable") or 0
  _stream_until(server, model_id, 3)
  for _ in range(200):
    if (server.metric("meshlm_kv_blocks_used", version="stable") == 0
        and server.metric("meshlm_client_disconnects_total", version="stable") == before + 1):
      break
    time.sleep(0.1)
  assert server.metric("meshlm_kv_blocks_used", version="stable") == 0
  assert server.metric("meshlm_client_disconnects_total", version="stable") == before + 1
  assert server.metric("meshlm_running_requests", version="stable") == 0
  # aborted, not finished: far fewer than its 200 tokens were ever generated
  time.sleep(1)
  assert server.metric("meshlm_generation_tokens_total", version="stable") - tokens < 100


def test_too_many_concurrent_requests_get_429_with_retry_after(server, model_id):
  body = {"model": model_id, "prompt": "Tell me a story.", "max_tokens": 40, "ignore_eos": True}

  def post(_):
    with server.client() as c:
      return c.post("/v1/completions", json=body)

  with concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT + 3) as pool:
    responses = list(pool.map(post, range(MAX_CONCURRENT + 3)))
  codes = sorted(r.status_code for r in responses)
  assert codes.count(200) >= MAX_CONCURRENT and 429 in codes, codes
  busy = next(r for r in responses if r.status_code == 429)
  assert busy.headers["retry-after"] == "1"
  assert busy.json()["error"]["type"] == "rate_limit_error"


def test_metrics_cover_the_serving_numbers(server):
  text = httpx.get(server.url + "/metrics", headers=server.headers).text
  for name in ("meshlm_requests_total", "meshlm_request_errors_total", "meshlm_queue_depth",
               "meshlm_time_to_first_token_seconds_bucket",
               "meshlm_time_per_output_token_seconds_bucket",
               "meshlm_generation_tokens_per_second", "meshlm_kv_blocks_used",
               "meshlm_monitor_value", "meshlm_release_state", "meshlm_canary_weight"):
    assert name in text, name
  assert server.metric("meshlm_release_state", state="stable") == 1
  assert KEY not in server.log()


def test_a_real_client_sees_errors_as_exceptions(client, model_id):
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="no-such-model", prompt="hi")
  with pytest.raises(openai.BadRequestError, match="context length"):
    client.completions.create(model=model_id, prompt="word " * 400, max_tokens=4)
  bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()
