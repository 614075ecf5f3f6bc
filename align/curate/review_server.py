"""The web page and JSON API over a review queue (align/curate/review_db.py): `meshlm review`
(cli/review.py) serves it.

API (JSON bodies and answers; errors are {"error": message}):
  GET  /                          the page (align/curate/review_page.py)
  GET  /api/progress?reviewer=R   {total, resolved, pending, leased, mine}
  GET  /api/report                the audit report
  POST /api/claim  {reviewer}                    -> {item | null, progress}
  POST /api/submit {reviewer, item_id, label}    -> {item: the next claim | null, progress}
  POST /api/undo   {reviewer}                    -> {item | null, undone_label, progress}
Status codes: 400 bad request, 404 unknown item or path, 409 item already resolved or leased
to another reviewer (nothing is recorded), 413 body too large.
"""

import json
import sys
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from align.curate.review_db import AlreadyResolved, LeaseConflict, ReviewQueue, UnknownItem
from align.curate.review_page import PAGE

_MAX_BODY = 64 * 1024
# Inline script and style only: the page loads nothing from anywhere (no network here).
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


class _ApiError(Exception):
  def __init__(self, status: HTTPStatus, message: str):
    super().__init__(message)
    self.status = status


class _Handler(BaseHTTPRequestHandler):
  server_version = "meshlm-review"
  protocol_version = "HTTP/1.1"

  # --- Plumbing ---

  def log_message(self, format, *args):
    if self.server.verbose:
      super().log_message(format, *args)

  def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
    self.send_response(status)
    self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(body)))
    self.send_header("Cache-Control", "no-store")
    self.send_header("X-Content-Type-Options", "nosniff")
    if content_type.startswith("text/html"):
      self.send_header("Content-Security-Policy", _CSP)
    self.end_headers()
    self.wfile.write(body)

  def _json(self, status: HTTPStatus, obj) -> None:
    self._send(status, json.dumps(obj).encode(), "application/json")

  def _body(self) -> dict:
    # A page on another site can POST text/plain to localhost without a CORS preflight;
    # requiring JSON (which needs one) keeps it from labelling on a reviewer's behalf.
    if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
      self.close_connection = True
      raise _ApiError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "POST bodies must be application/json")
    try:
      length = int(self.headers.get("Content-Length") or 0)
    except ValueError:
      self.close_connection = True
      raise _ApiError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
    if length > _MAX_BODY:
      self.close_connection = True  # the unread body would garble the next request
      raise _ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {_MAX_BODY} bytes")
    try:
      body = json.loads(self.rfile.read(length) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise _ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON ({e})") from e
    if not isinstance(body, dict):
      raise _ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    return body

  def _dispatch(self, route) -> None:
    try:
      status, obj = route()
      self._json(status, obj)
    except _ApiError as e:
      self._json(e.status, {"error": str(e)})
    except (AlreadyResolved, LeaseConflict) as e:
      self._json(HTTPStatus.CONFLICT, {"error": str(e)})
    except UnknownItem as e:
      self._json(HTTPStatus.NOT_FOUND, {"error": str(e)})
    except ValueError as e:
      self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
    except Exception as e:  # a bug: say so, keep serving
      traceback.print_exc(file=sys.stderr)
      self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {e!r}"})

  # --- Routes ---

  def do_GET(self):
    url = urlsplit(self.path)
    query = parse_qs(url.query)
    if url.path in ("/", "/index.html"):
      return self._send(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8")
    queue = self.server.queue
    routes = {
        "/api/progress": lambda: (HTTPStatus.OK,
                                  queue.progress(query.get("reviewer", [None])[0])),
        "/api/report": lambda: (HTTPStatus.OK, queue.report()),
    }
    self._dispatch(routes.get(url.path, self._not_found))

  def do_POST(self):
    routes = {"/api/claim": self._claim, "/api/submit": self._submit, "/api/undo": self._undo}
    route = routes.get(urlsplit(self.path).path, self._not_found)
    self._dispatch(lambda: route(self._body()))  # the body is read even for a 404

  def _not_found(self, body=None):
    raise _ApiError(HTTPStatus.NOT_FOUND, f"no such path {urlsplit(self.path).path}")

  def _claim(self, body):
    reviewer = body.get("reviewer")
    queue = self.server.queue
    item = queue.claim(reviewer)
    return HTTPStatus.OK, {"item": item, "progress": queue.progress(reviewer)}

  def _submit(self, body):
    reviewer, queue = body.get("reviewer"), self.server.queue
    queue.submit(body.get("item_id"), reviewer, body.get("label"))
    return HTTPStatus.OK, {"item": queue.claim(reviewer), "progress": queue.progress(reviewer)}

  def _undo(self, body):
    reviewer = body.get("reviewer")
    queue = self.server.queue
    item = queue.undo(reviewer)
    undone = item.pop("undone_label") if item else None
    if item is None:  # nothing to undo: keep showing what they hold
      item = queue.claim(reviewer)
    return HTTPStatus.OK, {"item": item, "undone_label": undone,
                           "progress": queue.progress(reviewer)}


def serve(queue: ReviewQueue, host: str = "127.0.0.1", port: int = 8765,
          verbose: bool = False) -> ThreadingHTTPServer:
  """A bound (not yet serving) server; call .serve_forever()."""
  server = ThreadingHTTPServer((host, port), _Handler)
  server.daemon_threads = True
  server.queue, server.verbose = queue, verbose
  return server
