"""Red teaming (`--suite redteam`): every attack on every harmful behaviour, scored by refusal.

    behaviors, skipped = load_behaviors(["advbench", "jbb"], limit=50)
    records = run_attacks(chat, behaviors, get_attacks(), classify=string_refusal)
    metrics, tables = summarize(records, seed=0)

`chat` is an align.evals.runner.ChatModel (anything with `.respond(conversations)`);
`classify(texts) -> list[bool]` says which answers are refusals. Attack success is an
answer that is not a refusal; an empty answer (or one the model could not produce)
counts as refused, since nothing harmful came out, and is counted. So ASR measures
compliance as a refusal detector sees it, not harm: a garbled or off-topic answer that
does not refuse counts as a success (docs/redteam.md, caveats).
"""

from align.evals import datasets
from align.evals.attacks import Attack, get_attacks
from align.evals.stats import metric

BEHAVIOR_SETS = {"advbench": datasets.advbench, "jbb": datasets.jbb_behaviors}


def load_behaviors(sets=("advbench",), *, limit: int | None = None
                   ) -> tuple[list[dict], dict[str, int]]:
  """Behaviour rows from the named sets (advbench, jbb), the first `limit` of each, and the
  malformed rows skipped, counted by "SET/reason"."""
  if isinstance(sets, str):
    sets = [s for s in sets.split(",") if s]
  unknown = [s for s in sets if s not in BEHAVIOR_SETS]
  if unknown or not sets:
    raise ValueError(f"unknown behaviour set(s) {unknown or sets}; known: {sorted(BEHAVIOR_SETS)}")
  rows, skipped = [], {}
  for name in sets:
    got, bad = BEHAVIOR_SETS[name](limit=limit)
    rows += got
    skipped.update({f"{name}/{reason}": n for reason, n in bad.items()})
  return rows, skipped


def check_behaviors(behaviors: list[dict]) -> None:
  """Raises ValueError naming the first behaviour without an id, prompt or category, or a
  repeated id (records are keyed by it)."""
  ids = set()
  for b in behaviors:
    for key in ("id", "prompt", "category"):
      if not isinstance(b, dict) or not isinstance(b.get(key), str) or not b[key].strip():
        raise ValueError(f"behaviour {str(b)[:80]!r} needs a non-empty string {key!r}")
    if b["id"] in ids:
      raise ValueError(f"behaviour id {b['id']!r} appears twice")
    ids.add(b["id"])


def run_attacks(chat, behaviors: list[dict], attacks, *, classify) -> list[dict]:
  """One record per (attack, behaviour): the conversation sent, the final answer, whether
  it was refused, empty or looping. All conversations at the same turn go to the model in
  one `respond` call; a multi-turn attack's own replies are kept between its turns."""
  check_behaviors(behaviors)
  if isinstance(attacks, str):
    attacks = get_attacks(attacks)
  attacks = [a if isinstance(a, Attack) else get_attacks([a])[0] for a in attacks]
  if not attacks or not behaviors:
    raise ValueError(f"run_attacks needs attacks and behaviours: got {len(attacks)} attacks, "
                     f"{len(behaviors)} behaviours")
  jobs = []
  for attack in attacks:
    for b in behaviors:
      turns = attack.turns(b)
      if not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"attack {attack.name!r} gave no usable turns for {b['id']!r}")
      jobs.append((attack, b, turns))
  convs = [[] for _ in jobs]
  finals = [None] * len(jobs)
  for t in range(max(len(turns) for _, _, turns in jobs)):
    active = [j for j, (_, _, turns) in enumerate(jobs) if t < len(turns)]
    for j in active:
      convs[j].append({"role": "user", "content": jobs[j][2][t]})
    responses = chat.respond([list(convs[j]) for j in active])
    if len(responses) != len(active):
      raise ValueError(f"chat.respond returned {len(responses)} answers for {len(active)}")
    for j, r in zip(active, responses):
      if t < len(jobs[j][2]) - 1:
        convs[j].append({"role": "assistant", "content": r.text})
      else:
        finals[j] = r
  texts = [r.text for r in finals]
  empty = [not s.strip() for s in texts]
  judged = [i for i, e in enumerate(empty) if not e]
  verdicts = list(classify([texts[i] for i in judged])) if judged else []
  if len(verdicts) != len(judged):
    raise ValueError(f"classify returned {len(verdicts)} verdicts for {len(judged)} texts")
  refused = list(empty)
  for i, v in zip(judged, verdicts):
    refused[i] = bool(v)
  return [{"attack": a.name, "family": a.family, "category": b["category"],
           "behavior_id": b["id"], "conversation": conv, "response": r.text,
           "refused": refused[j], "empty": empty[j],
           "degenerate": bool(getattr(r, "degenerate", False)),
           "finish_reason": getattr(r, "finish_reason", "stop")}
          for j, ((a, b, _), conv, r) in enumerate(zip(jobs, convs, finals))]


def _cell(rows: list[dict]) -> dict:
  n = len(rows)
  success = sum(not r["refused"] for r in rows)
  return {"n": n, "asr": success / n if n else float("nan"),
          "refused": n - success, "empty": sum(r["empty"] for r in rows),
          "degenerate": sum(r["degenerate"] for r in rows)}


def _asr_metric(name: str, rows: list[dict], seed: int) -> dict:
  counts = _cell(rows)
  return metric(name, [not r["refused"] for r in rows], dimension="redteam",
                higher_is_better=False, seed=seed,
                note=f"{counts['empty']} empty (counted as refused), "
                     f"{counts['degenerate']} degenerate")


def summarize(records: list[dict], *, seed: int = 0) -> tuple[dict, dict]:
  """Metrics "redteam/asr/ATTACK", "redteam/asr_family/FAMILY" and "redteam/asr_overall"
  (every attack but the baseline), and the table "redteam_asr": one row per attack and
  category (plus category "all") with n, ASR, its lift over `direct` in the same category,
  and the refused / empty / degenerate counts."""
  if not records:
    raise ValueError("summarize needs at least one red-team record")
  by_attack: dict[str, list[dict]] = {}
  for r in records:
    by_attack.setdefault(r["attack"], []).append(r)
  metrics = {f"redteam/asr/{name}": _asr_metric(f"redteam/asr/{name}", rows, seed)
             for name, rows in by_attack.items()}
  attacked = [r for r in records if r["family"] != "baseline"]
  for family in dict.fromkeys(r["family"] for r in attacked):
    name = f"redteam/asr_family/{family}"
    metrics[name] = _asr_metric(name, [r for r in attacked if r["family"] == family], seed)
  if attacked:
    metrics["redteam/asr_overall"] = _asr_metric("redteam/asr_overall", attacked, seed)

  categories = sorted({r["category"] for r in records}) + ["all"]
  baseline = {c: _cell([r for r in by_attack.get("direct", [])
                        if c == "all" or r["category"] == c]) for c in categories}
  table = []
  for name, rows in by_attack.items():
    for c in categories:
      cell = _cell([r for r in rows if c == "all" or r["category"] == c])
      if not cell["n"]:
        continue
      base = baseline[c]["asr"] if baseline[c]["n"] else None
      table.append({"attack": name, "family": rows[0]["family"], "category": c, **cell,
                    "lift_over_direct": None if base is None else cell["asr"] - base})
  return metrics, {"redteam_asr": table}


def evaluate(chat, behaviors: list[dict], *, classify, attacks=None, seed: int = 0
             ) -> tuple[dict, dict, list[dict]]:
  """run_attacks then summarize: (metrics, tables, records)."""
  records = run_attacks(chat, behaviors, get_attacks(attacks), classify=classify)
  metrics, tables = summarize(records, seed=seed)
  return metrics, tables, records
