"""Self-Instruct (Wang et al. 2022) with a meshlm model: `run` is `meshlm selfinstruct`
(cli/selfinstruct.py parses its flags).

  meshlm selfinstruct --config experiments/selfinstruct.py --out DIR [--config.KEY=VALUE ...]

Stages, each appending to a JSONL file in DIR as it goes:
  1. bootstrap   rounds of `prompts_per_round` list prompts (6 human seeds + 2 machine tasks,
                 fewer machine ones while the pool is small); each candidate is kept or gets
                 the first rejection reason: a rule filter (align/curate/selfinstruct_filters.py),
                 "rouge" (ROUGE-L > 0.7 against the pool), "semantic" (MiniLM cosine above
                 `semantic_threshold` against the pool). Until `num_instructions` are kept
                 or `max_rounds` ran.                                   -> rounds.jsonl
  2. classify    the few-shot "is it classification?" question, answered greedily by the
                 model; the examples are seed tasks with their is_classification labels.
                                                                        -> classify.jsonl
  3. instances   input-first (non-classification) or output-first (classification)
                 prompts, greedy; invalid / duplicate instances dropped, <= 5 per task.
                                                                        -> instances.jsonl
  4. the asset   ROOT/selfinstruct/vK (train.assets; ROOT = `asset_root`, default DIR)
                 and DIR/stats.json.

Generation: SmolLM2-135M-Instruct by default, through infer.Engine (bootstrap) and its
subclass infer.serving.PagedEngine (classify, instances: the few-shot head every prompt
shares is computed once by the prefix cache); `config.engines` sizes each.

Resuming: a killed run restarted with the same command reads the three files (a torn last
line is cut off), rebuilds the pool (re-embedding each finished round's candidates as one
batch, as the first time), and continues with the next round / task. Round r's prompts come
from random.Random(f"{seed}-round-{r}") and request i's sampling seed from (seed, r, i), so
a resumed run produces exactly what an uninterrupted one would. DIR/config.json pins the
config: another config in the same DIR is refused (more rounds and engine sizes excepted).
"""

import os
import random
import time

from align.curate import selfinstruct_filters as F
from align.curate.selfinstruct_io import JsonlLog, check_config, load_seeds, resolve, write_outputs
from infer import Engine, SamplingParams
from infer.embed import embed
from infer.serving import PagedEngine
from models import load_pretrained


class Generator:
  """The instruct model behind infer engines, one per stage (sized by config.engines.STAGE:
  kind "static" = infer.Engine, "paged" = infer.serving.PagedEngine, whose prefix cache
  computes a few-shot prompt's shared head once); counts the tokens it generates."""

  KINDS = ("static", "paged")

  def __init__(self, cfg):
    self.SamplingParams = SamplingParams
    self.cfg = cfg
    for stage in ("bootstrap", "classify", "instances"):
      if cfg.engines[stage].kind not in self.KINDS:
        raise ValueError(f"engines.{stage}.kind={cfg.engines[stage].kind!r}; choose one of "
                         f"{self.KINDS}")
    self.model_path = resolve(cfg.model, "model")
    self.model, self.tokenizer = load_pretrained(self.model_path)
    self.stage, self.engine = None, None
    self.tokens = 0

  def use(self, stage: str) -> None:
    if stage != self.stage:
      e = self.cfg.engines[stage]
      kw = dict(max_seq_len=e.max_seq_len, max_batch=e.max_batch,
                kv_dtype=self.cfg.kv_dtype or None)
      if e.kind == "paged":  # a pool sized to the work: each step copies all of it
        self.engine = PagedEngine(self.model, self.tokenizer, num_blocks=e.num_blocks or None,
                                  **kw)
      else:
        self.engine = Engine(self.model, self.tokenizer, **kw)
      self.stage = stage

  def __call__(self, stage: str, prompts: list[str], params: list) -> list:
    self.use(stage)
    results = self.engine.generate(prompts, params)
    if all(r.finish_reason == "error" for r in results):
      raise ValueError(f"{stage}: every generation request was refused: {results[0].error}")
    # A refused request (too long for engines.STAGE.max_seq_len) is counted by the caller.
    self.tokens += sum(len(r.token_ids) for r in results)
    return results


class Embedder:
  """MiniLM sentence embeddings (meshlm's BERT) of a pool and of candidates."""

  def __init__(self, path: str):
    self.model, self.tokenizer = load_pretrained(path)

  def __call__(self, texts: list[str]):
    return embed(self.model, self.tokenizer, texts)


def _request_seed(seed: int, stage: int, a: int, b: int) -> int:
  """A request's sampling seed: fixed by the run seed and the request's place, not by time."""
  return (seed * 1_000_003 + stage * 100_003 + a * 1009 + b) % (2**31 - 1)


def prompt_tasks(rng: random.Random, seeds: list[str], machine: list[str], cfg) -> list[str]:
  """The 8 tasks of one prompt: up to `prompt_machine` from the machine pool, the rest seeds,
  shuffled (the paper's sampling)."""
  tasks = rng.sample(machine, min(cfg.prompt_machine, len(machine)))
  tasks += rng.sample(seeds, cfg.prompt_tasks - len(tasks))
  rng.shuffle(tasks)
  return tasks


def bootstrap(cfg, out: str, gen: Generator, emb: Embedder, seeds: list[dict], log) -> list[dict]:
  """Stage 1; returns the kept instructions [{instruction, round, rouge, cos}] in order."""
  import numpy as np
  seed_texts = [F.one_line(s["instruction"]) for s in seeds]
  rouge = F.RougePool(seed_texts)
  pool_ND = emb(seed_texts)
  kept: list[dict] = []
  rounds = JsonlLog(os.path.join(out, "rounds.jsonl"))
  done = rounds.read()
  for rec in done:  # replay: the same embedding batches as the first time, so the same bits
    fresh = [c for c in rec["candidates"] if not F.heuristic_reason(c["instruction"])]
    cand_ND = emb([c["instruction"] for c in fresh]) if fresh else None
    for k, c in enumerate(fresh):
      if c["status"] == "kept":
        rouge.add(c["instruction"])
        pool_ND = np.concatenate([pool_ND, cand_ND[k][None]])
        kept.append(c)
  gen.tokens += sum(rec["tokens"] for rec in done)
  first = len(done)
  if first:
    log(f"resumed: {first} rounds done, {len(kept)} instructions kept")
  for r in range(first, cfg.max_rounds):
    if len(kept) >= cfg.num_instructions:
      break
    start = time.perf_counter()
    rng = random.Random(f"{cfg.seed}-round-{r}")
    machine = [c["instruction"] for c in kept]
    prompts = [F.encode_prompt(prompt_tasks(rng, seed_texts, machine, cfg))
               for _ in range(cfg.prompts_per_round)]
    nxt = cfg.prompt_tasks + 1
    stop = ("\n\n", f"Task {nxt + cfg.max_new_tasks}:")
    params = [gen.SamplingParams(max_tokens=cfg.gen.max_tokens, temperature=cfg.gen.temperature,
                                 top_p=cfg.gen.top_p, seed=_request_seed(cfg.seed, 1, r, i),
                                 stop=stop) for i in range(len(prompts))]
    tokens0 = gen.tokens
    results = gen("bootstrap", prompts, params)
    candidates, endings = [], {}
    for i, res in enumerate(results):
      tasks, ended = (([], "refused") if res.finish_reason == "error" else
                      F.parse_tasks(res.text, nxt, res.finish_reason))
      endings[ended] = endings.get(ended, 0) + 1
      candidates += [{"instruction": t, "prompt": i} for t in tasks]
    fresh = [c for c in candidates if not F.heuristic_reason(c["instruction"])]
    cand_ND = emb([c["instruction"] for c in fresh]) if fresh else None
    row = {id(c): k for k, c in enumerate(fresh)}
    for c in candidates:
      reason = F.heuristic_reason(c["instruction"])
      if reason is None:
        score, similar = rouge.max_score(c["instruction"])
        c["rouge"], c["rouge_nearest"] = score, similar
        if score > cfg.rouge_threshold:
          reason = "rouge"
        else:
          cos = float((pool_ND @ cand_ND[row[id(c)]]).max())
          c["cos"] = cos
          if cos > cfg.semantic_threshold:
            reason = "semantic"
      c["status"] = "kept" if reason is None else "rejected"
      if reason is None:
        c["round"] = r
        rouge.add(c["instruction"])
        pool_ND = np.concatenate([pool_ND, cand_ND[row[id(c)]][None]])
        kept.append(c)
      else:
        c["reason"] = reason
    rounds.append({"round": r, "prompts": len(prompts), "tokens": gen.tokens - tokens0,
                   "endings": endings, "seconds": round(time.perf_counter() - start, 2),
                   "candidates": candidates})
    log(f"round {r}: {len(candidates)} candidates, "
        f"{sum(c['status'] == 'kept' for c in candidates)} kept, {len(kept)} in the pool, "
        f"{gen.tokens - tokens0} tokens, {time.perf_counter() - start:.1f}s")
  return kept


def _pick(rng: random.Random, tasks: list[dict], n: int, max_chars: int) -> list[dict]:
  short = [t for t in tasks if len(t["instruction"]) + sum(
      len(i["input"]) + len(i["output"]) for i in t["instances"]) <= max_chars]
  return rng.sample(short, min(n, len(short)))


def classify(cfg, out: str, gen: Generator, seeds: list[dict], kept: list[dict], log) -> dict:
  """Stage 2: {instruction: {"is_classification": bool, "answer": text}}."""
  rng = random.Random(f"{cfg.seed}-clf-shots")
  half = cfg.clf_shots // 2
  shots = (rng.sample([s for s in seeds if s["is_classification"]], half)
           + rng.sample([s for s in seeds if not s["is_classification"]], cfg.clf_shots - half))
  rng.shuffle(shots)
  examples = [(s["instruction"], s["is_classification"]) for s in shots]
  path = os.path.join(out, "classify.jsonl")
  logf = JsonlLog(path)
  labels = {rec["instruction"]: rec for rec in logf.read()}
  todo = [c["instruction"] for c in kept if c["instruction"] not in labels]
  for start in range(0, len(todo), cfg.stage_batch):
    batch = todo[start:start + cfg.stage_batch]
    results = gen("classify", [F.clf_prompt(examples, t) for t in batch],
                  [gen.SamplingParams(max_tokens=2, temperature=0.0)] * len(batch))
    for t, res in zip(batch, results):
      answer = F.parse_clf(res.text)
      rec = {"instruction": t, "answer": res.error or res.text, "tokens": len(res.token_ids),
             "parsed": answer is not None,
             "is_classification": bool(answer)}  # the paper: anything but "Yes" is "No"
      logf.append(rec)
      labels[t] = rec
    log(f"classified {min(start + len(batch), len(todo))}/{len(todo)}")
  return labels


def instances(cfg, out: str, gen: Generator, seeds: list[dict], kept: list[dict],
              labels: dict, log) -> dict:
  """Stage 3: {instruction: {"instances": [...], "rejected": {reason: n}, ...}}."""
  rng = random.Random(f"{cfg.seed}-instance-demos")
  gen_demos = _pick(rng, [s for s in seeds if not s["is_classification"]], cfg.instance_demos,
                    cfg.demo_max_chars)
  clf_demos = _pick(rng, [s for s in seeds if s["is_classification"]], cfg.instance_demos,
                    cfg.demo_max_chars)
  logf = JsonlLog(os.path.join(out, "instances.jsonl"))
  done = {rec["instruction"]: rec for rec in logf.read()}
  todo = [c["instruction"] for c in kept if c["instruction"] not in done]
  stop = ("Task:", f"Example {cfg.max_instances + 1}")
  for start in range(0, len(todo), cfg.stage_batch):
    batch = todo[start:start + cfg.stage_batch]
    clf = [labels[t]["is_classification"] for t in batch]
    prompts = [F.output_first_prompt(clf_demos, t) if c else F.input_first_prompt(gen_demos, t)
               for t, c in zip(batch, clf)]
    params = [gen.SamplingParams(max_tokens=cfg.instance_max_tokens, temperature=0.0, stop=stop)
              for _ in batch]
    for t, c, res in zip(batch, clf, gen("instances", prompts, params)):
      parse = F.parse_clf_instances if c else F.parse_gen_instances
      pairs = None if res.finish_reason == "error" else parse(res.text, res.finish_reason)
      if res.finish_reason == "error":
        good, rejected = [], {"request_refused": 1}
      elif pairs is None:
        good, rejected = [], {"parse_failure": 1}
      else:
        good, rejected = F.clean_instances(pairs, cfg.max_instances)
        if res.finish_reason == "length" and res.text.strip():
          rejected["truncated"] = 1  # the cut-off last instance parse_* dropped
      rec = {"instruction": t, "is_classification": c, "raw": res.error or res.text,
             "finish_reason": res.finish_reason, "tokens": len(res.token_ids),
             "parsed": 0 if pairs is None else len(pairs),
             "instances": [{"input": i, "output": o} for i, o in good],
             "rejected": {k: v for k, v in dict(rejected).items() if v}}
      logf.append(rec)
      done[t] = rec
    log(f"instances for {min(start + len(batch), len(todo))}/{len(todo)} tasks")
  return done


def run(cfg, out: str, log=print) -> dict:
  """The whole pipeline; returns the stats (also in OUT/stats.json)."""
  start = time.perf_counter()
  os.makedirs(out, exist_ok=True)
  check_config(cfg, out)
  seed_path = resolve(cfg.seed_tasks, "seed_tasks")
  seeds = load_seeds(seed_path)
  gen = Generator(cfg)
  emb = Embedder(resolve(cfg.encoder, "encoder"))
  log(f"{len(seeds)} seed tasks; generator {gen.model_path}; encoder loaded")
  kept = bootstrap(cfg, out, gen, emb, seeds, log)
  labels = classify(cfg, out, gen, seeds, kept, log)
  inst = instances(cfg, out, gen, seeds, kept, labels, log)
  return write_outputs(cfg, out, seed_path, gen.model_path, kept, labels, inst,
                       time.perf_counter() - start, log)
