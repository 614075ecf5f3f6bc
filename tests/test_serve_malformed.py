"""Malformed and hostile requests against a real `meshlm serve`: each gets the right 4xx, the
server keeps serving, and the API key never reaches its log."""

import json
import socket

import httpx
import pytest

import deps
from serve_util import ServeProcess

SMOLLM = deps.smollm()
KEY = "sk-meshlm-hostile-fedcba9876543210"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  log = tmp_path_factory.mktemp("serve") / "server.log"
  s = ServeProcess(["--model", SMOLLM, "--served_model_name", "smollm2",
                    "--max_model_len", "128", "--max_num_seqs", "2", "--max_tokens", "64",
                    "--max_body_bytes", str(BODY_LIMIT), "--api_key", KEY], str(log))
  yield s
  s.stop()


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
MSG = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


RAW = (f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
       "Content-Type: application/json\r\n").encode()


def raw_status(server, request: bytes) -> tuple[int, str]:
  """Sends bytes no well-behaved client would send; (status, response text)."""
  with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
      more = sock.recv(65536)
      if not more:
        break
      data += more
  return int(data.split(b" ", 2)[1]), data.decode(errors="replace")


def j(**kw) -> bytes:
  return json.dumps(dict(OK, **kw)).encode()


def chat(**kw) -> bytes:
  return json.dumps(dict(MSG, **kw)).encode()


# (name, path, body bytes, headers, expected status)
CASES = [
    ("broken json", C, b'{"model": "smollm2", "prompt": ', AUTH, 400),
    ("trailing garbage", C, j() + b"}", AUTH, 400),
    ("not an object", C, b"[1, 2, 3]", AUTH, 400),
    ("empty body", C, b"", AUTH, 400),
    ("NaN literal", C, b'{"model": "smollm2", "prompt": "x", "temperature": NaN}', AUTH, 400),
    ("invalid utf-8", C, b'{"model": "smollm2", "prompt": "\xff\xfe\xfa"}', AUTH, 400),
    ("lone surrogate", C, b'{"model": "smollm2", "prompt": "\\ud800"}', AUTH, 400),
    ("deep nesting", C, b"[" * 30000 + b"]" * 30000, AUTH, 400),
    ("huge max_tokens", C, j(max_tokens=10 ** 30), AUTH, 400),
    ("huge float", C, b'{"model": "smollm2", "prompt": "x", "temperature": 1e999}', AUTH, 400),
    ("negative max_tokens", C, j(max_tokens=-5), AUTH, 400),
    ("zero max_tokens", C, j(max_tokens=0), AUTH, 400),
    ("float max_tokens", C, j(max_tokens=3.5), AUTH, 400),
    ("string max_tokens", C, j(max_tokens="10"), AUTH, 400),
    ("bool temperature", C, j(temperature=True), AUTH, 400),
    ("negative temperature", C, j(temperature=-1), AUTH, 400),
    ("top_p zero", C, j(top_p=0), AUTH, 400),
    ("n too big", C, j(n=1000), AUTH, 400),
    ("seed too big", C, j(seed=2 ** 70), AUTH, 400),
    ("prompt is a number", C, j(prompt=42), AUTH, 400),
    ("prompt list of dicts", C, j(prompt=[{"a": 1}]), AUTH, 400),
    ("token id out of vocab", C, j(prompt=[1, 2, 10 ** 9]), AUTH, 400),
    ("prompt over context", C, j(prompt="word " * 500), AUTH, 400),
    ("prompt + max_tokens over context", C, j(prompt="word " * 100, max_tokens=64), AUTH, 400),
    ("unknown field", C, j(temprature=0.5), AUTH, 400),
    ("unsupported penalty", C, j(presence_penalty=1.0), AUTH, 400),
    ("stop not strings", C, j(stop=[1, 2]), AUTH, 400),
    ("too many stops", C, j(stop=["a", "b", "c", "d", "e"]), AUTH, 400),
    ("missing model", C, json.dumps({"prompt": "x"}).encode(), AUTH, 400),
    ("model not a string", C, j(model=["smollm2"]), AUTH, 400),
    ("unknown model", C, j(model="gpt-4"), AUTH, 404),
    ("path traversal model", C, j(model="../../../../etc/passwd"), AUTH, 404),
    ("absolute path model", C, j(model=SMOLLM), AUTH, 404),
    ("10 MB body", C, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', AUTH, 413),
    ("10 MB chunked body", C, [b'{"prompt": "'] + [b"a" * (1 << 20)] * 10 + [b'"}'], AUTH, 413),
    ("lying content-length", C, RAW + b"Content-Length: 999999999\r\n\r\n" + j(), None, 413),
    ("bad content-length", C, RAW + b"Content-Length: -1\r\n\r\n" + j(), None, 400),
    ("chat: no messages", CHAT, chat(messages=[]), AUTH, 400),
    ("chat: bad role", CHAT, chat(messages=[{"role": "root", "content": "x"}]), AUTH, 400),
    ("chat: content not text", CHAT, chat(messages=[{"role": "user", "content": 5}]), AUTH, 400),
    ("chat: image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), AUTH, 400),
    ("chat: tools", CHAT, chat(tools=[{"type": "function"}]), AUTH, 400),
    ("chat: top_logprobs without logprobs", CHAT, chat(top_logprobs=3), AUTH, 400),
    ("chat: stream_options without stream", CHAT, chat(stream_options={"include_usage": True}),
     AUTH, 400),
    ("no API key", C, j(), {"Content-Type": "application/json"}, 401),
    ("wrong API key", C, j(), dict(AUTH, Authorization="Bearer sk-wrong"), 401),
    ("key without Bearer", C, j(), dict(AUTH, Authorization=KEY), 401),
    ("key as basic auth", C, j(), dict(AUTH, Authorization=f"Basic {KEY}"), 401),
    ("GET on a POST endpoint", C, None, AUTH, 405),
    ("unknown path", "/v1/../../etc/passwd", j(), AUTH, 404),
    ("admin promote without canary", "/admin/promote", b"{}", AUTH, 409),
    ("admin weight not a number", "/admin/weight", b'{"weight": "all"}', AUTH, 400),
]


def test_every_hostile_request_gets_the_right_4xx_and_the_server_keeps_serving(server):
  assert len(CASES) >= 30
  wrong = []
  with httpx.Client(base_url=server.url, timeout=120) as c:
    for name, path, body, headers, expected in CASES:
      if headers is None:
        status, text = raw_status(server, body)
        if status != expected:
          wrong.append((name, expected, status, text[:200]))
        continue
      if body is None:
        r = c.get(path, headers=headers)
      else:
        r = c.post(path, content=iter(body) if isinstance(body, list) else body,
                   headers=headers)
      ok = r.status_code == expected
      if ok and expected != 405:  # OpenAI's error body, with a message that says something
        err = r.json().get("error", {})
        ok = isinstance(err.get("message"), str) and len(err["message"]) > 5 and "type" in err
      if not ok:
        wrong.append((name, expected, r.status_code, r.text[:200]))
    good = c.post(C, content=j(), headers=AUTH)  # after them all, it still answers
  assert not wrong, wrong
  assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
  health = httpx.get(server.url + "/health")
  assert health.status_code == 200
  log = server.log()
  assert KEY not in log
  assert "Traceback" not in log, log[-3000:]  # every case was refused, none crashed a handler


def test_error_bodies_name_the_problem(server):
  with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
    r = c.post(C, content=j(max_tokens=-5))
    assert r.json()["error"]["param"] == "max_tokens" and "-5" in r.json()["error"]["message"]
    r = c.post(C, content=j(temprature=0.5))
    assert "temprature" in r.json()["error"]["message"]
    r = c.post(C, content=j(model="../x"))
    assert r.json()["error"]["code"] == "model_not_found"
    r = c.post(C, content=j(prompt="word " * 500))
    assert r.json()["error"]["code"] == "context_length_exceeded"
