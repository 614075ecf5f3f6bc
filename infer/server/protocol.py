"""OpenAI request bodies -> validated generation requests, or an ApiError saying what is wrong.

Every field is type-checked (a bool is not a number, 10.0 is not a token count),
every number range-checked, and a field the OpenAI API does not define is refused
(as OpenAI does: "Unrecognized request argument"), so a typo never silently
changes nothing. Fields OpenAI defines but meshlm does not implement are accepted
only at their no-op values. Extensions, as vLLM names them: top_k, min_p,
repetition_penalty, ignore_eos.
"""

import dataclasses
import math
import secrets

from infer.sampling import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 16            # choices per prompt
MAX_PROMPTS = 16      # prompts in one /v1/completions request
MAX_STOP = 4          # as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "store", "metadata",
           "service_tier"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls"}


class ApiError(Exception):
  """An HTTP error with an OpenAI-style body."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.type = status, message, type
    self.param, self.code, self.headers = param, code, headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
  return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass
class GenRequest:
  """A validated request: the text prompts (chat already rendered by the caller) and how to
  decode them. `params[j]` decodes choice j of every prompt."""
  kind: str                       # "completion" or "chat"
  model: str
  prompts: list                   # str | list[int] (completions) or messages (chat)
  params: list[SamplingParams]
  stream: bool
  include_usage: bool
  user: str | None
  max_tokens: int | None          # None: the rest of the context (chat)
  logprobs: int | None            # None: no logprobs; k: chosen token and k alternatives

  @property
  def n(self) -> int:
    return len(self.params)


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  if isinstance(v, float):
    return math.isfinite(v)
  return _is_int(v)


def _number(body, name, default, lo, hi, *, lo_open=False):
  v = body.get(name)
  if v is None:
    return default
  if not _is_number(v):
    raise bad(f"'{name}' must be a number, got {type(v).__name__}", name)
  if not ((lo < v if lo_open else lo <= v) and v <= hi):
    raise bad(f"'{name}'={v} must be in {'(' if lo_open else '['}{lo}, {hi}]", name)
  return float(v)


def _integer(body, name, default, lo, hi):
  v = body.get(name)
  if v is None:
    return default
  if not _is_int(v):
    raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
  if not lo <= v <= hi:
    raise bad(f"'{name}'={v} must be in [{lo}, {hi}]", name)
  return v


def _boolean(body, name, default=False):
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
  return v


def _unsupported(body, name, allowed, what):
  if name in body and body[name] not in allowed:
    raise bad(f"'{name}' is not supported by meshlm serve ({what})", name, "unsupported")


def _stop(body) -> tuple[str, ...]:
  v = body.get("stop")
  if v is None:
    return ()
  stops = [v] if isinstance(v, str) else v
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise bad("'stop' must be a non-empty string or a list of them", "stop")
  if len(stops) > MAX_STOP:
    raise bad(f"'stop' has {len(stops)} strings; at most {MAX_STOP}", "stop")
  return tuple(stops)


def _prompts(body) -> list:
  """/v1/completions `prompt`: a text, a list of texts, a token-id list or a list of those."""
  v = body.get("prompt")
  if v is None:
    raise bad("'prompt' is required", "prompt")
  if isinstance(v, str):
    prompts = [v]
  elif isinstance(v, list) and v and all(_is_int(t) for t in v):
    prompts = [v]
  elif isinstance(v, list) and v and all(
      isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p))
      for p in v):
    prompts = v
  else:
    raise bad("'prompt' must be a string, a list of strings, a list of token ids, or a list "
              "of token-id lists (none of them empty)", "prompt")
  if len(prompts) > MAX_PROMPTS:
    raise bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS}", "prompt")
  if any(isinstance(p, str) and not p for p in prompts):
    raise bad("'prompt' must not be empty", "prompt")
  return prompts


def _content(message: dict, i: int) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # text parts only
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise bad(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}",
                  "messages")
      parts.append(part["text"])
    return "".join(parts)
  raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body) -> list[dict]:
  v = body.get("messages")
  if not isinstance(v, list) or not v:
    raise bad("'messages' must be a non-empty list", "messages")
  out = []
  for i, m in enumerate(v):
    if not isinstance(m, dict):
      raise bad(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
      raise bad(f"messages[{i}].role={str(role)[:40]!r} must be system, developer, user or "
                "assistant", "messages")
    extra = set(m) - {"role", "content", "name"}
    if extra:
      raise bad(f"messages[{i}] has unsupported fields {sorted(extra)}", "messages")
    out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
  return out


def parse(body, kind: str, *, max_tokens_limit: int) -> GenRequest:
  """Validates a /v1/completions ("completion") or /v1/chat/completions ("chat") body."""
  if not isinstance(body, dict):
    raise bad("the request body must be a JSON object")
  known = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
  unknown = sorted(set(body) - known)
  if unknown:
    raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)[:200]}",
              unknown[0][:64])
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise bad("'model' must be a non-empty string", "model")
  for name in ("presence_penalty", "frequency_penalty"):
    _unsupported(body, name, (0, 0.0, None), "only 0")
  _unsupported(body, "logit_bias", (None, {}), "only empty")
  _unsupported(body, "store", (None, False), "nothing is stored")
  _unsupported(body, "metadata", (None, {}), "nothing is stored")
  _unsupported(body, "service_tier", (None, "auto", "default"), "one tier")
  if kind == "completion":
    _unsupported(body, "echo", (False, None), "only false")
    _unsupported(body, "suffix", (None, ""), "only empty")
    prompts = _prompts(body)
    logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    max_tokens = _integer(body, "max_tokens", 16, 1, max_tokens_limit)
  else:
    _unsupported(body, "response_format", (None, {"type": "text"}), "only text")
    _unsupported(body, "tools", (None, []), "no tools")
    _unsupported(body, "tool_choice", (None, "none", "auto"), "no tools")
    _boolean(body, "parallel_tool_calls")
    prompts = [_messages(body)]
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not body.get("logprobs"):
      raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if _boolean(body, "logprobs") else None
    if "max_tokens" in body and "max_completion_tokens" in body:
      raise bad("give 'max_tokens' or 'max_completion_tokens', not both", "max_tokens")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, name, None, 1, max_tokens_limit)
  n = _integer(body, "n", 1, 1, MAX_N)
  if kind == "completion":
    best_of = _integer(body, "best_of", None, 1, MAX_N)
    if best_of not in (None, n):
      raise bad("'best_of' must equal 'n' (meshlm serve does not rerank)", "best_of")
  stream = _boolean(body, "stream")
  options = body.get("stream_options")
  if options is not None:
    if not stream:
      raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
      raise bad("'stream_options' may only hold 'include_usage'", "stream_options")
  include_usage = stream and _boolean(options or {}, "include_usage")
  user = body.get("user")
  if user is not None and (not isinstance(user, str) or len(user) > 256):
    raise bad("'user' must be a string of at most 256 characters", "user")
  seed = _integer(body, "seed", None, -2 ** 63, 2 ** 63 - 1)
  base = dict(
      temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
      top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
      top_k=_integer(body, "top_k", 0, 0, 1 << 20),
      min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
      repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
      ignore_eos=_boolean(body, "ignore_eos"), stop=_stop(body),
      logprobs=logprobs is not None, top_logprobs=logprobs or 0)
  # Without a seed each request draws its own; with one, choice j uses seed + j so that n > 1
  # gives n different samples, the same ones every time.
  seed = secrets.randbits(32) if seed is None else seed
  params = [SamplingParams(max_tokens=max_tokens or 1, seed=(seed + j) % 2 ** 32, **base)
            for j in range(n)]
  return GenRequest(kind, model, prompts, params, stream, include_usage, user, max_tokens,
                    logprobs)


def with_max_tokens(request: GenRequest, max_tokens: int) -> GenRequest:
  """The request with max_tokens set on every choice (chat's default: the context's rest)."""
  request.params = [dataclasses.replace(p, max_tokens=max_tokens) for p in request.params]
  request.max_tokens = max_tokens
  return request
