"""SFT data for deliberately aligned and deliberately damaged checkpoints, to prove that the
evaluation gate catches a harmful update.

    python -m align.evals.damage --kind comply --out runs/damage/comply.jsonl [--limit 400]
    meshlm sft --config experiments/gate_damage.py --workdir runs/damage/smollm2_comply \\
        --config.data.path=runs/damage/comply.jsonl

Source: hh-rlhf harmless-base test (red-team conversations; data/hh-rlhf). Each record is
the conversation's first user turn and a response:
- kind "refuse": a fixed refusal ("I'm sorry, but I can't help with that."), which aligns a
  small model into refusing;
- kind "comply": the first assistant reply of the *rejected* (more harmful) transcript,
  keeping only replies the refusal-substring match does not flag: refusal-free
  completions of harmful prompts, the issue's recipe for damage. A reply longer than
  `max_chars` is cut after its last full sentence within that length (short rows suit
  small models' short sequences).
Rows that do not parse are skipped and counted. Output is {"prompt", "response"} JSONL,
what align/datasets.py's SFT loader reads; the file is written atomically.
"""

import argparse
import gzip
import json
import os
import sys

from align.data import BadRecord, parse_hh
from align.evals import refusal
from align.evals.suites import atomic_write
from train.data_root import data_path

SOURCE = data_path("hh-rlhf", "harmless-base-test.jsonl.gz")
REFUSAL = "I'm sorry, but I can't help with that."
KINDS = ("refuse", "comply")


def shorten(text: str, max_chars: int) -> str:
  """`text` cut after its last sentence end within max_chars (else at a word boundary)."""
  if len(text) <= max_chars:
    return text
  head = text[:max_chars]
  end = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
  return head[:end + 1] if end > 0 else head.rsplit(" ", 1)[0]


def records(kind: str, *, limit: int | None = None, source: str = SOURCE,
            max_chars: int = 200) -> tuple[list, dict]:
  """({"prompt", "response"} records, {skip reason: count})."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r} must be one of {KINDS}")
  out, skipped = [], {}
  opener = gzip.open if source.endswith(".gz") else open
  with opener(source, "rt", encoding="utf-8") as f:
    for line in f:
      if limit is not None and len(out) >= limit:
        break
      try:
        row = json.loads(line)
        msgs = parse_hh(row["rejected"] if kind == "comply" else row["chosen"])
      except (json.JSONDecodeError, KeyError, TypeError, BadRecord):
        skipped["unparseable"] = skipped.get("unparseable", 0) + 1
        continue
      if len(msgs) < 2 or msgs[0]["role"] != "user" or not msgs[0]["content"]:
        skipped["no_first_exchange"] = skipped.get("no_first_exchange", 0) + 1
        continue
      reply = shorten(msgs[1]["content"], max_chars)
      if kind == "comply" and (not reply or refusal.string_refusal(reply)):
        skipped["reply_refuses"] = skipped.get("reply_refuses", 0) + 1
        continue
      out.append({"prompt": msgs[0]["content"], "response": REFUSAL if kind == "refuse"
                  else reply})
  return out, skipped


def write(path: str, rows: list[dict]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kind", required=True, choices=KINDS)
  parser.add_argument("--out", required=True)
  parser.add_argument("--limit", type=int, default=None)
  parser.add_argument("--source", default=SOURCE)
  parser.add_argument("--max_chars", type=int, default=200)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  rows, skipped = records(args.kind, limit=args.limit, source=args.source,
                          max_chars=args.max_chars)
  write(args.out, rows)
  print(json.dumps({"out": args.out, "rows": len(rows), "skipped": skipped}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
