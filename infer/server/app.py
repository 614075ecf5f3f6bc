"""The Starlette app of `meshlm serve`: OpenAI endpoints, health, metrics, release admin.

    GET  /health                    200 while the engines run (no API key needed)
    GET  /v1/models                 the served model
    POST /v1/completions            OpenAI completions, streamed with "stream": true
    POST /v1/chat/completions       OpenAI chat completions, likewise
    GET  /metrics                   Prometheus text (infer/server/metrics.py)
    GET  /admin/release             the gray release's state, monitors and history
    POST /admin/rollback {reason}   all traffic to stable
    POST /admin/promote  {reason}   the canary becomes stable
    POST /admin/weight   {weight}   the canary's share of traffic

Errors have OpenAI's body {"error": {message, type, param, code}}: 400 bad request,
401 missing or wrong API key, 404 unknown model or path, 405, 413 body too large,
429 too many requests in flight (with Retry-After), 500 a failed generation.
"""

import hmac
import json
import logging
import math

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from infer.server.protocol import ApiError, bad

log = logging.getLogger("meshlm.serve")

ENDPOINTS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics",
             "/admin/release", "/admin/rollback", "/admin/promote", "/admin/weight")


def _clean(obj):
  """JSON has no NaN: an empty monitor's value is null."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  if isinstance(obj, dict):
    return {k: _clean(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_clean(v) for v in obj]
  return obj


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
  body = json.dumps(_clean(obj), ensure_ascii=False).encode()
  return Response(body, status, headers, media_type="application/json")


def error_response(e: ApiError) -> Response:
  return json_response(e.body(), e.status, e.headers)


async def read_json(request: Request, limit: int):
  """The body as JSON; 413 past `limit` bytes (before reading it all), 400 if not UTF-8 JSON."""
  length = request.headers.get("content-length")
  if length is not None and (not length.isdigit() or int(length) > limit):
    raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
  chunks, size = [], 0
  try:
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
      chunks.append(chunk)
  except ClientDisconnect:  # gone during the upload: nobody to answer
    raise ApiError(499, "client disconnected", code="client_disconnected") from None
  raw = b"".join(chunks)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise bad(f"the request body is not valid UTF-8 (byte {e.start})") from None

  def no_constants(name):
    raise ValueError(f"{name} is not valid JSON")

  try:
    body = json.loads(text, parse_constant=no_constants)
  except (ValueError, RecursionError) as e:
    raise bad(f"the request body is not valid JSON: {str(e)[:200]}") from None
  try:  # "\ud800" is valid JSON but no text: refuse it here, not in the tokenizer
    json.dumps(body, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError:
    raise bad("the request holds a lone UTF-16 surrogate (\\ud800-\\udfff escape)") from None
  return body


class Guard:
  """ASGI middleware: the API key (constant-time compare), and request counts by status."""

  def __init__(self, app, server):
    self.app, self.server = app, server

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    path = scope["path"]
    endpoint = path if path in ENDPOINTS else "other"
    status = {}

    async def counting_send(message):
      if message["type"] == "http.response.start":
        status["code"] = message["status"]
      await send(message)

    try:
      key = self.server.api_key
      if key is not None and path != "/health" and not _authorized(scope, key):
        await error_response(ApiError(401, "missing or wrong API key (Authorization: Bearer "
                                      "KEY)", type="authentication_error",
                                      code="invalid_api_key"))(scope, receive, counting_send)
        return
      await self.app(scope, receive, counting_send)
    finally:
      code = status.get("code", 500)
      self.server.metrics.requests.labels(endpoint, str(code)).inc()
      if code >= 400:  # failed generations are also counted by version, as "generation"
        self.server.metrics.errors.labels("client" if code < 500 else "http_5xx", "").inc()


def _authorized(scope, key: str) -> bool:
  given = b""
  for name, value in scope["headers"]:
    if name == b"authorization":
      given = value
  scheme, _, token = given.partition(b" ")
  ok = hmac.compare_digest(token.strip(), key.encode())  # the same time for any wrong key
  return ok and scheme.lower() == b"bearer"


def build_app(server) -> Starlette:
  """The ASGI app over an infer.server.generation.Server."""

  async def health(request):
    dead = {role: w.dead or "stopped" for role, w in server.versions.roles.items()
            if not w.alive}
    return json_response({"status": "error" if dead else "ok", "dead": dead,
                          "versions": sorted(server.versions.roles),
                          "release": server.release.state}, 503 if dead else 200)

  async def models(request):
    return json_response({"object": "list", "data": [
        {"id": server.model_name, "object": "model", "created": int(server.versions.started),
         "owned_by": "meshlm", "max_model_len": server.versions["stable"].max_seq_len}]})

  async def completions(request):
    return await server.handle(request, "completion")

  async def chat(request):
    return await server.handle(request, "chat")

  async def metrics(request):
    return Response(server.metrics.render(server.versions, server.release),
                    media_type=CONTENT_TYPE_LATEST)

  async def release(request):
    return json_response(server.release.describe())

  async def admin(request):
    body = await read_json(request, server.max_body_bytes) if _has_body(request) else {}
    if not isinstance(body, dict):
      raise bad("the request body must be a JSON object")
    action = request.url.path.rsplit("/", 1)[1]
    reason = body.get("reason", "requested")
    if not isinstance(reason, str) or len(reason) > 500:
      raise bad("'reason' must be a string of at most 500 characters", "reason")
    try:
      if action == "rollback":
        server.rollback(reason)
      elif action == "promote":
        await server.promote(reason)
      else:
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
          raise bad("'weight' must be a number in [0, 1]", "weight")
        server.release.set_weight(float(weight))
    except ValueError as e:
      raise ApiError(409, str(e), code="release_state") from None
    return json_response(server.release.describe())

  async def on_api_error(request, e: ApiError):
    return error_response(e)

  async def on_http_error(request, e: HTTPException):
    kind = "not_found" if e.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(e.status_code, e.detail or "error", type=kind))

  async def on_crash(request, e: Exception):
    log.exception("unhandled error in %s", request.url.path)
    return error_response(ApiError(500, "internal server error", type="server_error"))

  routes = [Route("/health", health), Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/metrics", metrics), Route("/admin/release", release)]
  routes += [Route(f"/admin/{a}", admin, methods=["POST"])
             for a in ("rollback", "promote", "weight")]
  app = Starlette(routes=routes, exception_handlers={
      ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
  return Guard(app, server)


def _has_body(request: Request) -> bool:
  return request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers

