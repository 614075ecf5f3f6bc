"""The evaluation suites behind `meshlm eval` (cli/eval.py) and the promotion gate: run one
on a model, score its dimensions, write its reports.

`hhh` runs helpful, harmless and honest; `redteam` runs the attack library
(align/evals/attacks.py). A `limit` takes the first N valid rows of every dataset.

The output directory receives report.json (every metric: value, n, bootstrap 95% CI),
report.html (one self-contained page with plots) and responses.jsonl (every answer, for
audit). Each file is written to a temporary name and renamed, so a crash leaves no
half-written report. The same model, suite, limit and seed give a byte-identical report.json.
"""

import hashlib
import json
import os

from align.evals import harmless, helpful, honest, html, judges, redteam_suite
from align.evals.runner import ChatModel, output_counts
from align.evals.stats import oriented
from train.workdir import MERGED, is_workdir

SUITES = {"hhh": ("helpful", "harmless", "honest"), "helpful": ("helpful",),
          "harmless": ("harmless",), "honest": ("honest",), "redteam": ("redteam",)}
# 2: the judge is named by its weights (report["judge"], align/evals/judges.py)
SCHEMA = 2
# The protected evaluation sets (data/protected_evals.json) each dimension reads: training
# data is checked against them (train/decontam.py), so they stay held out.
DIMENSION_SETS = {"helpful": ("alpaca-eval", "mt-bench", "self-instruct-user"),
                  "harmless": ("advbench", "xstest", "jbb-behaviors"),
                  "honest": ("truthfulqa", "unanswerable"),
                  "redteam": ("advbench", "jbb-behaviors")}


def suite_sets(suite: str) -> list[str]:
  return sorted({s for dim in SUITES[suite] for s in DIMENSION_SETS[dim]})


def _model_files(path: str) -> list[str]:
  """The files a model load reads: a file itself; of a meshlm workdir (of a LoRA run: its
  merged model) the config, tokenizer and newest checkpoint only, not its logs or evals;
  of any other directory, all its files."""
  if os.path.isfile(path):
    return [path]
  if is_workdir(path):
    if is_workdir(os.path.join(path, MERGED)):
      return _model_files(os.path.join(path, MERGED))
    steps = [d for d in os.listdir(os.path.join(path, "checkpoints")) if d.isdigit()] if \
        os.path.isdir(os.path.join(path, "checkpoints")) else []
    roots = ["model_config.json", "tokenizer"] + (
        [os.path.join("checkpoints", max(steps, key=int))] if steps else [])
  else:
    roots = [""]
  files = []
  for root in roots:
    full = os.path.join(path, root)
    files += [full] if os.path.isfile(full) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(full) for f in fs)
  return files


def fingerprint(path: str) -> str:
  """sha256 over the model's files (names relative to `path`, and bytes)."""
  h = hashlib.sha256()
  for name in _model_files(path):
    h.update(os.path.relpath(name, path).encode() if name != path else b"")
    with open(name, "rb") as f:
      for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
  return h.hexdigest()


def run_suite(chat, suite: str, *, limit: int | None, seed: int, judge=None) -> dict:
  """Runs the suite's dimensions on `chat` (runner.ChatModel); returns the report's body.
  Without a `judge` the win rates are left out."""
  parts = []
  for dim in SUITES[suite]:
    if dim == "helpful":
      parts.append(helpful.evaluate(chat, judge, limit=limit, seed=seed))
    elif dim == "harmless":
      parts.append(harmless.evaluate(chat, limit=limit, seed=seed))
    elif dim == "honest":
      parts.append(honest.evaluate(chat, limit=limit, seed=seed))
    else:
      parts.append(redteam_suite.evaluate(chat, limit=limit, seed=seed))
  return merge_parts(parts)


def merge_parts(parts: list[dict]) -> dict:
  body = {"metrics": {}, "tables": {}, "examples": {}, "skipped": {}, "counts": {}}
  responses = []
  for p in parts:
    for key in ("metrics", "tables", "examples", "skipped"):
      body[key].update(p.get(key, {}))
    responses += list(p.get("responses", []))
  body["counts"] = output_counts(responses)
  body["responses"] = responses
  return body


def dimension_scores(metrics: dict) -> dict:
  """Each dimension's score: the mean of its metrics turned so that higher is better."""
  out = {}
  for name, m in sorted(metrics.items()):
    out.setdefault(m["dimension"], {"metrics": []})["metrics"].append(name)
  for dim, d in out.items():
    vals = [oriented(metrics[n]) for n in d["metrics"]
            if metrics[n]["value"] == metrics[n]["value"]]  # NaN: no examples
    d["score"] = sum(vals) / len(vals) if vals else float("nan")
  return out


def build_report(body: dict, *, suite: str, seed: int, limit: int | None, model: dict,
                 settings: dict, judge: dict | None = None,
                 examples_per_metric: int = 5) -> dict:
  return {"schema": SCHEMA, "suite": suite, "seed": seed, "limit": limit, "model": model,
          "settings": settings, "judge": judge, "metrics": body["metrics"],
          "dimensions": dimension_scores(body["metrics"]), "tables": body["tables"],
          "counts": body["counts"], "skipped": body["skipped"],
          "examples": {k: v[:examples_per_metric] for k, v in body["examples"].items()}}


def atomic_write(path: str, text: str) -> None:
  """`text` to `path` through a temporary file and a rename: never half-written."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_outputs(out_dir: str, report: dict, examples: dict) -> None:
  """report.json, responses.jsonl and report.html, each written atomically."""
  os.makedirs(out_dir, exist_ok=True)
  lines = []
  for metric_name, rows in sorted(examples.items()):
    for i, row in enumerate(rows):
      lines.append(json.dumps({"metric": metric_name, "i": i, **row}, ensure_ascii=False))
  atomic_write(os.path.join(out_dir, "responses.jsonl"), "\n".join(lines) + "\n")
  atomic_write(os.path.join(out_dir, "report.json"),
                json.dumps(report, indent=1, sort_keys=True, allow_nan=True) + "\n")
  atomic_write(os.path.join(out_dir, "report.html"), html.render(report))


def evaluate_model(model, tokenizer, suite: str, out_dir: str | None, *, limit: int | None,
                   seed: int = 0, judge=None, model_info: dict | None = None,
                   max_new_tokens: int = 128, batch_size: int = 8) -> dict:
  """Runs `suite` on a loaded model; writes the outputs when `out_dir`; returns the report.

  `judge` (a PairwiseJudge; its .name, if set, names it in the report) scores the win
  rates; without one the evaluated model judges its own answers, and the report says so
  (report["judge"]["self"]: the gate will not compare those win rates)."""
  if suite not in SUITES:
    raise ValueError(f"unknown suite {suite!r}; choose one of {sorted(SUITES)}")
  if limit is not None and limit < 1:
    raise ValueError(f"--limit={limit} must be >= 1")
  chat = ChatModel(model, tokenizer, max_new_tokens=max_new_tokens, batch_size=batch_size)
  model_info = dict(model_info or {}, weights_sha256=judges.weights_fingerprint(model))
  record = None
  if "helpful" in SUITES[suite]:
    if judge is None:
      judge = helpful.judge_for(None, chat)  # None: no chat template, no win rates
      name = model_info.get("name") or "the evaluated model"
      if judge is not None:
        record = judges.self_record(name, model_info["weights_sha256"])
    else:
      record = judges.judge_record(judge, getattr(judge, "name", None) or "unnamed judge",
                                   model_info["weights_sha256"])
  body = run_suite(chat, suite, limit=limit, seed=seed, judge=judge)
  settings = {"max_new_tokens": chat.max_new_tokens, "max_prompt_tokens": chat.max_prompt_tokens,
              "decoding": "greedy", "batch_size": batch_size}
  report = build_report(body, suite=suite, seed=seed, limit=limit, model=model_info,
                        settings=settings, judge=record)
  if out_dir:
    write_outputs(out_dir, report, body["examples"])
  return report
