"""Loaders for the evaluation sets bundled under data/ (data/README.md, data/evals/README.md).

Every loader returns (rows, skipped): rows are small dicts in file order, skipped maps a
reason ("missing:goal", "empty:prompt", "type:turns", "bad_json", "bad_label", ...) to how
many rows it dropped. Each takes a path override and `limit` (the first N valid rows).

Bad input never crashes silently and never passes silently:
  - a missing file raises FileNotFoundError naming it;
  - a malformed row is skipped and counted;
  - a file with no rows, or where more than half of the rows are malformed, raises
    ValueError naming the first bad row (it is the wrong file, or a broken one).
The whole file is always read, so that check and `skipped` do not depend on `limit`.
"""

import collections
import csv
import json
import os
from typing import Any, Callable, Iterable

from train.data_root import data_dir

DATA = data_dir()
PATHS = {
  "advbench": "advbench/harmful_behaviors.csv",
  "jbb_behaviors": "jailbreakbench/jbb_behaviors_100.derived.csv",
  "jbb_artifact": "jailbreakbench/artifact_DSN_white_box_llama-2-7b-chat-hf.json",
  "jbb_artifact_gcg": "jailbreakbench/artifact_GCG_white_box_llama-2-7b-chat-hf.first22.derived.json",
  "xstest": "xstest/xstest_prompts.csv",
  "truthfulqa_mc": "truthfulqa/mc_task.json",
  "alpaca_eval": "alpaca-eval/text_davinci_003_model_outputs.json",
  "mt_bench": "mt-bench/mt_bench_question.jsonl",
  "mt_bench_reference": "mt-bench/mt_bench_reference_answer_gpt-4.jsonl",
  "selfinstruct_user": "self-instruct/user_oriented_instructions.jsonl",
  "unanswerable": "evals/unanswerable.jsonl",
  "refusal_labels": "evals/refusal_labels.jsonl",
}
REFUSAL_LABELS = ("refusal", "compliance")
XSTEST_LABELS = ("safe", "unsafe")
UNANSWERABLE_KINDS = ("private", "future", "unknowable", "false_premise", "undefined")


class Bad(Exception):
  """A malformed row; its message is the skip reason."""


def default_path(name: str) -> str:
  return os.path.join(DATA, PATHS[name])


# --- Field checks ---


def text(rec: Any, key: str, *, allow_empty: bool = False) -> str:
  """rec[key] as a string, stripped of surrounding whitespace; Bad if absent/empty/not a str."""
  if not isinstance(rec, dict):
    raise Bad("not_object")
  if key not in rec or rec[key] is None:
    raise Bad(f"missing:{key}")
  value = rec[key]
  if not isinstance(value, str):
    raise Bad(f"type:{key}")
  if not value.strip() and not allow_empty:
    raise Bad(f"empty:{key}")
  return value.strip()


def _targets(rec: dict, key: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """TruthfulQA {choice: 0/1} targets as (choices, labels); Bad unless >= 1 correct choice."""
  targets = rec.get(key)
  if targets is None:
    raise Bad(f"missing:{key}")
  if not isinstance(targets, dict) or not targets:
    raise Bad(f"type:{key}")
  for choice, label in targets.items():
    if not choice.strip() or type(label) is not int or label not in (0, 1):
      raise Bad(f"type:{key}")
  if not any(targets.values()):
    raise Bad(f"no_correct_answer:{key}")
  return tuple(targets), tuple(targets.values())


# --- Readers: (where, record) items; a record that cannot be parsed is a Bad ---


def _check_file(path: str, what: str) -> None:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what}: {path} does not exist")


def read_csv(path: str) -> Iterable[tuple[str, Any]]:
  with open(path, encoding="utf-8-sig", newline="") as f:
    reader = csv.DictReader(f)
    for rec in reader:
      where = f"{path}:{reader.line_num}"
      # csv puts surplus cells under None and fills missing cells with None
      yield where, (Bad("bad_csv_row") if None in rec else rec)


def read_jsonl(path: str) -> Iterable[tuple[str, Any]]:
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield f"{path}:{n}", json.loads(line)
      except json.JSONDecodeError:
        yield f"{path}:{n}", Bad("bad_json")


def read_json_list(path: str, key: str | None = None) -> Iterable[tuple[str, Any]]:
  """The items of a JSON list (or of the list under `key` of a JSON object)."""
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
  if key is not None:
    if not isinstance(data, dict) or key not in data:
      raise ValueError(f"{path}: expected a JSON object with a {key!r} list")
    data = data[key]
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
  return ((f"{path}[{i}]", rec) for i, rec in enumerate(data))


def load(path: str, what: str, records: Iterable[tuple[str, Any]],
         parse: Callable[[int, Any, collections.Counter], list[dict] | dict],
         limit: int | None = None) -> tuple[list[dict], dict[str, int]]:
  """Parse every record (parse(i, rec, skipped) -> row(s) or raise Bad), count skips, refuse
  an empty or mostly-malformed file, then keep the first `limit` rows."""
  if limit is not None and (type(limit) is not int or limit < 1):
    raise ValueError(f"{what}: limit={limit!r} must be a positive int or None")
  rows, skipped = [], collections.Counter()
  total = bad = 0
  first_bad = None
  for i, (where, rec) in enumerate(records):
    total += 1
    try:
      if isinstance(rec, Bad):
        raise rec
      out = parse(i, rec, skipped)
    except Bad as e:
      bad += 1
      skipped[str(e)] += 1
      first_bad = first_bad or f"{where} ({e})"
      continue
    rows.extend(out if isinstance(out, list) else [out])
  if total == 0:
    raise ValueError(f"{what}: {path} has no rows")
  if bad * 2 > total:
    raise ValueError(f"{what}: {path}: {bad} of {total} rows are malformed, so this is not a "
                     f"{what} file; first bad row: {first_bad}")
  return (rows if limit is None else rows[:limit]), dict(skipped)


def _csv(name: str, path: str | None, parse, limit):
  path = path or default_path(name)
  _check_file(path, name)
  return load(path, name, read_csv(path), parse, limit)


def _jsonl(name: str, path: str | None, parse, limit):
  path = path or default_path(name)
  _check_file(path, name)
  return load(path, name, read_jsonl(path), parse, limit)


def _json(name: str, path: str | None, parse, limit, key: str | None = None):
  path = path or default_path(name)
  _check_file(path, name)
  return load(path, name, read_json_list(path, key), parse, limit)


# --- Harmful requests ---


def advbench(path: str | None = None, limit: int | None = None):
  """AdvBench harmful behaviors: {id, prompt (goal), target, category: "advbench"}."""
  return _csv("advbench", path, lambda i, r, _: {
    "id": f"advbench-{i}", "prompt": text(r, "goal"), "target": text(r, "target"),
    "category": "advbench"}, limit)


def jbb_behaviors(path: str | None = None, limit: int | None = None):
  """JailbreakBench's 100 behaviors: {id, prompt (goal), behavior, category}."""
  return _csv("jbb_behaviors", path, lambda i, r, _: {
    "id": f"jbb-{text(r, 'index')}", "prompt": text(r, "goal"),
    "behavior": text(r, "behavior"), "category": text(r, "category")}, limit)


def xstest(path: str | None = None, label: str | None = None, limit: int | None = None):
  """XSTest prompts {id, prompt, type, label}; label="safe"|"unsafe" keeps one half (rows
  of the other half are not counted as skipped)."""
  if label is not None and label not in XSTEST_LABELS:
    raise ValueError(f"xstest: label={label!r}; choose one of {XSTEST_LABELS} or None")

  def parse(i, r, _):
    row_label = text(r, "label")
    if row_label not in XSTEST_LABELS:
      raise Bad("bad_label")
    row = {"id": f"xstest-{text(r, 'id')}", "prompt": text(r, "prompt"),
           "type": text(r, "type"), "label": row_label}
    return [row] if label is None or row_label == label else []
  return _csv("xstest", path, parse, limit)


# --- Helpfulness ---


def alpaca_eval(path: str | None = None, limit: int | None = None):
  """AlpacaEval's 805 instructions: {id, instruction, reference (text-davinci-003's output;
  "" in the 2 rows where it produced nothing, kept as AlpacaEval keeps them), dataset}."""
  return _json("alpaca_eval", path, lambda i, r, _: {
    "id": f"alpaca-{i}", "instruction": text(r, "instruction"),
    "reference": text(r, "output", allow_empty=True), "dataset": text(r, "dataset")}, limit)


def _mt_references(path: str) -> tuple[dict[int, str], dict[str, int]]:
  def parse(i, r, _):
    qid = r.get("question_id") if isinstance(r, dict) else None
    if type(qid) is not int:
      raise Bad("missing:question_id")
    try:
      first = r["choices"][0]["turns"][0]
    except (KeyError, IndexError, TypeError):
      raise Bad("missing:choices") from None
    if not isinstance(first, str) or not first.strip():
      raise Bad("empty:choices")
    return {"question_id": qid, "answer": first.strip()}
  _check_file(path, "mt_bench references")
  rows, skipped = load(path, "mt_bench references", read_jsonl(path), parse)
  return {r["question_id"]: r["answer"] for r in rows}, skipped


def mt_bench(path: str | None = None, reference_path: str | None = None,
             with_reference_only: bool = False, limit: int | None = None):
  """MT-Bench first turns: {id, category, prompt, reference (the first-turn GPT-4 reference
  answer, or None)}. Skips in the reference file are counted as "reference:REASON"."""
  refs, ref_skipped = _mt_references(reference_path or default_path("mt_bench_reference"))

  def parse(i, r, _):
    qid = r.get("question_id") if isinstance(r, dict) else None
    if type(qid) is not int:
      raise Bad("missing:question_id")
    turns = r.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
      raise Bad("type:turns")
    if not turns[0].strip():
      raise Bad("empty:turns")
    if with_reference_only and qid not in refs:
      return []
    return {"id": f"mt-{qid}", "category": text(r, "category"), "prompt": turns[0].strip(),
            "reference": refs.get(qid)}
  rows, skipped = _jsonl("mt_bench", path, parse, limit)
  skipped.update({f"reference:{k}": v for k, v in ref_skipped.items()})
  return rows, skipped


def selfinstruct_user(path: str | None = None, limit: int | None = None):
  """Self-Instruct's 252 user-oriented tasks, one row per instance: {id ("TASK/k"),
  instruction, input (may be ""), output}. A bad instance is skipped as "instance:REASON"
  without dropping the task's other instances."""
  def parse(i, r, skipped):
    task_id, instruction = text(r, "id"), text(r, "instruction")
    instances = r.get("instances")
    if not isinstance(instances, list) or not instances:
      raise Bad("type:instances")
    rows = []
    for k, inst in enumerate(instances):
      try:
        rows.append({"id": f"{task_id}/{k}", "instruction": instruction,
                     "input": text(inst, "input", allow_empty=True),
                     "output": text(inst, "output")})
      except Bad as e:
        skipped[f"instance:{e}"] += 1
    return rows
  return _jsonl("selfinstruct_user", path, parse, limit)


# --- Honesty ---


def truthfulqa_mc(path: str | None = None, limit: int | None = None):
  """TruthfulQA MC: {id, question, mc1: (choices, labels), mc2: (choices, labels)}; a row
  with no correct choice in mc1 or mc2 is malformed."""
  return _json("truthfulqa_mc", path, lambda i, r, _: {
    "id": f"truthfulqa-{i}", "question": text(r, "question"),
    "mc1": _targets(r, "mc1_targets"), "mc2": _targets(r, "mc2_targets")}, limit)


def unanswerable(path: str | None = None, limit: int | None = None):
  """Hand-written questions no model can answer with a fact: {id, question, kind}."""
  def parse(i, r, _):
    kind = text(r, "kind")
    if kind not in UNANSWERABLE_KINDS:
      raise Bad("bad_kind")
    return {"id": text(r, "id"), "question": text(r, "question"), "kind": kind}
  return _jsonl("unanswerable", path, parse, limit)


# --- Refusal-labelled responses ---


def refusal_labels(path: str | None = None, limit: int | None = None):
  """The hand-labelled held-out set: {id, prompt, response, label in REFUSAL_LABELS}."""
  def parse(i, r, _):
    label = text(r, "label")
    if label not in REFUSAL_LABELS:
      raise Bad("bad_label")
    return {"id": text(r, "id"), "prompt": text(r, "prompt"),
            "response": text(r, "response"), "label": label}
  return _jsonl("refusal_labels", path, parse, limit)


def jbb_artifact_responses(path: str | None = None, limit: int | None = None):
  """A JailbreakBench attack artifact's judged responses: {id, prompt (the attack prompt, or
  the goal where a derived file dropped it), response, label} with label "compliance" where
  JBB's judge says jailbroken, else "refusal". Rows without a response are skipped as
  "no_response". Default: the DSN artifact; PATHS["jbb_artifact_gcg"] is the other one."""
  def parse(i, r, _):
    if not isinstance(r, dict):
      raise Bad("not_object")
    if r.get("response") is None or (isinstance(r["response"], str)
                                     and not r["response"].strip()):
      raise Bad("no_response")
    if type(r.get("jailbroken")) is not bool:
      raise Bad("bad_label")
    index = r.get("index")
    return {"id": f"jbb-artifact-{index if type(index) is int else i}",
            "prompt": text(r, "prompt" if "prompt" in r else "goal"),
            "response": text(r, "response"),
            "label": "compliance" if r["jailbroken"] else "refusal"}
  return _json("jbb_artifact", path, parse, limit, key="jailbreaks")
