"""Prompt pools: prompts read from a public dataset, checked, split and kept as data assets.

A pool source is one of
  hh        hh-rlhf transcripts (.jsonl/.jsonl.gz with "chosen"): the first human turn;
  alpaca    a JSON list with "instruction" (AlpacaEval's model_outputs.json);
  jsonl     one JSON object a line with a `text_key` string field.
Malformed rows (bad JSON, a missing or non-string field, empty or over-long text, a repeat)
are skipped and counted by reason; a source where most rows are bad is refused, naming the
first bad line, since it is then more likely the wrong file or format than noise.

Every prompt gets a stable bucket u in [0, 1) from a hash of its text: u < eval_fraction
goes to the independent evaluation set (never used to build training data), then
calib_fraction of the rest to the judge's calibration set, the rest to the pool.
"""

import gzip
import hashlib
import json
import os
import zlib

from align.data import BadRecord, pair_from_record, parse_hh
from train.decontam import build_index, check_rows

FORMATS = ("hh", "alpaca", "jsonl")
MAX_BAD_SHARE = 0.5


def bucket(text: str, seed: int = 0) -> float:
  digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2 ** 64


def prompt_id(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


class BadPrompt(ValueError):
  def __init__(self, reason: str, detail: str):
    super().__init__(f"{reason}: {detail}")
    self.reason = reason


def _lines(path: str):
  """(line number, row): a .json list's objects, else each non-blank line as bytes (decoded
  per line, so one bad byte costs one row, not the file)."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      if path.endswith(".json") or path.endswith(".json.gz"):
        data = json.load(f)
        if not isinstance(data, list):
          raise ValueError(f"prompt pool {path}: a .json source must hold a list of objects")
        yield from ((i + 1, row) for i, row in enumerate(data))
        return
      for i, line in enumerate(f):
        if line.strip():
          yield i + 1, line
  except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"prompt pool {path}: cannot read it ({type(e).__name__}: {e})") from None


def _prompt(row, fmt: str, text_key: str) -> str:
  if isinstance(row, bytes):
    try:
      row = json.loads(row.decode("utf-8"))
    except UnicodeDecodeError:
      raise BadPrompt("bad_encoding", "not UTF-8") from None
    except json.JSONDecodeError:
      raise BadPrompt("bad_json", "not a JSON object") from None
  if not isinstance(row, dict):
    raise BadPrompt("not_an_object", f"a {type(row).__name__}, not a JSON object")
  if fmt == "hh":
    text = parse_hh(row.get("chosen"))[0]["content"]
  else:
    text = row.get("instruction" if fmt == "alpaca" else text_key)
    if not isinstance(text, str):
      raise BadPrompt("missing_fields", "no prompt text field")
  return text.strip()


def read_pool(path: str, fmt: str = "hh", *, text_key: str = "prompt",
              max_chars: int = 2000) -> tuple[list[str], dict]:
  """(unique prompts in file order, report {"rows", "kept", "skipped": {reason: n},
  "first_bad": {reason: line}})."""
  if fmt not in FORMATS:
    raise ValueError(f"prompt pool format {fmt!r}: choose one of {FORMATS}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"prompt pool {path} does not exist")
  prompts, seen = [], set()
  report = {"rows": 0, "kept": 0, "skipped": {}, "first_bad": {}}

  def skip(reason: str, line: int):
    report["skipped"][reason] = report["skipped"].get(reason, 0) + 1
    report["first_bad"].setdefault(reason, line)

  for line, row in _lines(path):
    report["rows"] += 1
    try:
      text = _prompt(row, fmt, text_key)
    except (BadRecord, BadPrompt) as e:
      skip(e.reason, line)
      continue
    if not text:
      skip("empty", line)
    elif len(text) > max_chars:
      skip("too_long", line)
    elif text in seen:
      skip("duplicate", line)
    else:
      seen.add(text)
      prompts.append(text)
  report["kept"] = len(prompts)
  bad = report["rows"] - report["kept"] - report["skipped"].get("duplicate", 0)
  if report["rows"] == 0 or bad > MAX_BAD_SHARE * report["rows"]:
    raise ValueError(f"prompt pool {path} (format {fmt!r}): {bad} of {report['rows']} rows "
                     f"are malformed ({report['skipped']}; first bad line per reason: "
                     f"{report['first_bad']}); wrong file or --config.pool.format?")
  return prompts, report


def drop_contaminated(prompts: list[str], eval_sets: str = "default", n: int = 13
                      ) -> tuple[list[str], dict]:
  """The prompts that share no n-gram with a protected evaluation set (train/decontam.py),
  and {eval set: prompts dropped}: a pool must not turn evaluation prompts into training
  data (hh-rlhf's helpful-base openings are where AlpacaEval's helpful_base came from)."""
  if not eval_sets:
    return prompts, {}
  report = check_rows(prompts, build_index(eval_sets, n=n))
  bad = {o.row for o in report.overlaps}
  return [p for i, p in enumerate(prompts) if i not in bad], report.by_set()


def split_prompts(prompts: list[str], *, eval_fraction: float, calib_fraction: float,
                  seed: int = 0) -> dict[str, list[str]]:
  """{"eval", "calib", "pool"}: a stable split by each prompt's hash bucket."""
  if not (0 <= eval_fraction < 1 and 0 <= calib_fraction < 1 and
          eval_fraction + calib_fraction < 1):
    raise ValueError(f"eval_fraction={eval_fraction} and calib_fraction={calib_fraction} "
                     "must be >= 0 and sum to < 1")
  out = {"eval": [], "calib": [], "pool": []}
  for p in prompts:
    u = bucket(p, seed)
    name = ("eval" if u < eval_fraction else
            "calib" if u < eval_fraction + calib_fraction else "pool")
    out[name].append(p)
  return out


def labelled_pairs(path: str, prompts: set[str], limit: int) -> list[tuple[str, str, str]]:
  """Up to `limit` single-turn (prompt, chosen, rejected) hh-rlhf pairs whose prompt is in
  `prompts`: answers the judge is calibrated against."""
  out = []
  for _, row in _lines(path):
    try:
      pair = pair_from_record(json.loads(row) if isinstance(row, bytes) else row)
    except (BadRecord, json.JSONDecodeError, UnicodeDecodeError):
      continue
    if len(pair.prompt) == 1 and pair.prompt[0]["content"] in prompts:
      out.append((pair.prompt[0]["content"], pair.chosen, pair.rejected))
      if len(out) == limit:
        break
  return out
