"""Arithmetic word problems with exact answers: a verifiable reward for GRPO and PPO.

    python -m align.arith --out data/arith --seed 0 --train 2000 --heldout 300 \\
        --steps 1 --max-operand 20 --ops +-     (data/arith: see its PROVENANCE.md)

A problem is one line of sentences: a start ("Tom has 12 apples."), `steps` operations
("He buys 5 more apples.", "Then he gives 3 apples to Ann.", ...) and a question. Operations:
  +  buys / is given / finds n more            -  gives away / sells / loses n (never below 0)
  *  gets k packs of n (adds k*n, k in 2..5)   /  shares all equally among k (last step only,
                                                  k in 2..5 dividing the amount exactly)
Operands n are drawn from 2..max_operand, the start too (so no count reads "1 apples").
Every sentence comes from the fixed templates below, so `parse_problem` recovers the answer
from the text alone: the reward needs no side table and scores any prompt that holds a
problem (`answer_of_prompt`).

Split, by equation: a problem is held out iff sha256 of its equation (`Problem.equation`, the
start and each operation with its numbers, left to right: "7+5", "12-3+2*4/3"), read as an integer,
% HELDOUT_MODULUS == 0, whatever seed or wording made it. No equation is in both splits, so
held-out accuracy measures sums never trained on, not new phrasings of known ones. The
prompt record is {"prompt": problem + "\\n" + INSTRUCTION, "answer": int, "equation": str}.

Final answer of a completion (`final_answer`): the first number after its last "Answer:"
(case-insensitive), else its last number; "1,200" reads as 1200, "6.0" as 6.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import sys
from fractions import Fraction

INSTRUCTION = 'Solve the problem. End your reply with "Answer: " followed by the number.'
HELDOUT_MODULUS = 5  # held out: sha256(equation) % HELDOUT_MODULUS == 0
FACTORS = (2, 3, 4, 5)  # k of the "*" and "/" operations
OPS = "+-*/"

NAMES = {"Tom": "he", "Sam": "he", "Leo": "he", "Ben": "he", "Omar": "he", "Ravi": "he",
         "Ann": "she", "Mia": "she", "Emma": "she", "Lily": "she", "Sara": "she", "Nina": "she"}
PRONOUNS = {"he": ("he", "him"), "she": ("she", "her")}
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells",
         "coins", "eggs", "balloons", "candies")
CONNECTORS = ("", "Then ", "After that, ")  # before every operation but the first

# Sentences by operation; {he}/{him}: the person's pronouns, {friend}: another name.
START = ("{name} has {n} {item}.", "{name} starts the day with {n} {item}.",
         "{name} collected {n} {item}.")
STEPS = {
    "+": ("{he} buys {n} more {item}.", "{friend} gives {him} {n} {item}.",
          "{he} finds {n} more {item}."),
    "-": ("{he} gives {n} {item} to {friend}.", "{he} sells {n} {item}.",
          "{he} loses {n} {item}."),
    "*": ("{he} buys {k} packs of {item} with {n} in each pack.",
          "{friend} gives {him} {k} bags with {n} {item} in each bag."),
    "/": ("{he} shares all the {item} equally among {k} friends.",
          "{he} puts all the {item} into {k} boxes with the same number in each box."),
}
QUESTIONS = ("How many {item} does {name} have now?",
             "How many {item} does {name} have in the end?",
             "How many {item} does {name} have left?")  # last: only after a "-" step
SHARE_QUESTIONS = ("How many {item} does each friend get?", "How many {item} are in each box?")


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """The defaults are data/arith's: SmolLM2-135M-Instruct starts at about a fifth right."""
  steps: int = 1         # operations after the start
  max_operand: int = 20  # n (and the start) from 2..max_operand
  ops: str = "+-"        # a subset of OPS

  def __post_init__(self):
    if self.steps < 1 or self.max_operand < 2 or not self.ops or set(self.ops) - set(OPS):
      raise ValueError(f"difficulty {self}: needs steps >= 1, max_operand >= 2 and ops from "
                       f"{OPS!r}")
    if self.ops == "/" and self.steps > 1:
      raise ValueError(f"difficulty {self}: '/' is a last step only; add another op")


@dataclasses.dataclass(frozen=True)
class Problem:
  text: str
  answer: int
  ops: str       # the operations, in order
  equation: str  # the start, then each operation with its numbers: "7+5", "9-2+3*4/2"

  def record(self) -> dict:
    return {"prompt": f"{self.text}\n{INSTRUCTION}", "answer": self.answer,
            "equation": self.equation}


def render(template: str, **slots) -> str:
  text = template.format(**slots)
  return text[0].upper() + text[1:]


def _choose_op(rng: random.Random, d: Difficulty, value: int, last: bool) -> str | None:
  ok = [op for op in d.ops if (op != "-" or value >= 2) and
        (op != "/" or (last and any(value % k == 0 and value >= k for k in FACTORS)))]
  return rng.choice(ok) if ok else None


def make_problem(rng: random.Random, d: Difficulty) -> Problem | None:
  """One problem drawn from `rng`, or None where `d.ops` allows no operation at some step."""
  name = rng.choice(sorted(NAMES))
  he, him = PRONOUNS[NAMES[name]]
  item = rng.choice(ITEMS)
  friend = rng.choice(sorted(set(NAMES) - {name}))
  value = rng.randint(2, d.max_operand)
  words = dict(name=name, he=he, him=him, item=item, friend=friend)
  sentences = [render(rng.choice(START), n=value, **words)]
  op, ops, equation = None, "", str(value)
  for i in range(d.steps):
    op = _choose_op(rng, d, value, last=i == d.steps - 1)
    if op is None:
      return None
    k = rng.choice([f for f in FACTORS if op != "/" or (value % f == 0 and value >= f)])
    n = rng.randint(2, min(value, d.max_operand) if op == "-" else d.max_operand)
    ops += op
    equation += {"+": f"+{n}", "-": f"-{n}", "*": f"+{k}*{n}", "/": f"/{k}"}[op]
    value = {"+": value + n, "-": value - n, "*": value + k * n, "/": value // k}[op]
    connector = rng.choice(CONNECTORS) if i else ""
    template = rng.choice(STEPS[op])
    sentences.append(render(connector + template, n=n, k=k, **words))
  if op == "/":  # the question that goes with the share sentence just written
    question = SHARE_QUESTIONS[STEPS["/"].index(template)]
  else:  # "have left?" only where something went away
    question = rng.choice(QUESTIONS if "-" in ops else QUESTIONS[:2])
  sentences.append(render(question, **words))
  return Problem(" ".join(sentences), value, ops, equation)


# --- Parsing: the answer from the problem text alone ---


def _alternatives(words) -> str:
  return "(?:" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + ")"


def _pronoun(index: int) -> str:
  forms = {p[index] for p in PRONOUNS.values()}
  return _alternatives(forms | {f.capitalize() for f in forms})


SLOTS = {"name": _alternatives(NAMES), "friend": _alternatives(NAMES), "item": _alternatives(ITEMS),
         "he": _pronoun(0), "him": _pronoun(1), "n": r"(?P<n>\d+)", "k": r"(?P<k>\d+)"}


def _pattern(template: str, connectors: bool = False) -> re.Pattern:
  body = re.escape(template)
  for slot, pattern in SLOTS.items():
    body = body.replace(re.escape("{" + slot + "}"), pattern)
  lead = _alternatives([c for c in CONNECTORS if c]) + "?" if connectors else ""
  return re.compile(r"(?<!\w)" + lead + body, re.IGNORECASE)  # found in text: whole words


START_PATTERNS = [_pattern(t) for t in START]
STEP_PATTERNS = [(op, _pattern(t, connectors=True)) for op, ts in STEPS.items() for t in ts]
QUESTION_PATTERNS = [(False, _pattern(t)) for t in QUESTIONS] + \
    [(True, _pattern(t)) for t in SHARE_QUESTIONS]


def _match(patterns, sentence: str) -> list:
  return [(tag, m) for tag, p in patterns if (m := p.fullmatch(sentence))]


def parse_problem(text: str) -> int:
  """The answer of a problem line made by `make_problem`; ValueError for any other text."""
  sentences = re.split(r"(?<=[.?])\s+", text.strip())
  if len(sentences) < 3:
    raise ValueError(f"not an arithmetic problem: {text[:80]!r}")
  start = _match([(None, p) for p in START_PATTERNS], sentences[0])
  question = _match(QUESTION_PATTERNS, sentences[-1])
  if not start or not question:
    raise ValueError(f"not an arithmetic problem: {text[:80]!r}")
  value, op = Fraction(int(start[0][1]["n"])), None
  for sentence in sentences[1:-1]:
    found = _match(STEP_PATTERNS, sentence)
    if len({op for op, _ in found}) != 1:
      raise ValueError(f"{len(found)} operations match {sentence!r}")
    op, m = found[0]
    n, k = (int(m.groupdict().get(slot) or 0) for slot in ("n", "k"))
    if op == "/" and not k:
      raise ValueError(f"a share among 0 in {sentence!r}")
    value = {"+": value + n, "-": value - n, "*": value + k * n, "/": value / max(k, 1)}[op]
    if value < 0 or value.denominator != 1:
      raise ValueError(f"{sentence!r} leaves {value}, not a whole count: {text[:80]!r}")
  if question[0][0] != (op == "/"):
    raise ValueError(f"the question does not fit the last operation: {text[:80]!r}")
  return int(value)


def answer_of_prompt(prompt_text: str) -> int:
  """The answer of the last problem in `prompt_text`, e.g. a decoded chat prompt, where a
  chat template may put a role name before it on its line ("User: Tom has ..."): the last
  span of a line from a start sentence to the first question after it that parses whole.
  ValueError if there is none."""
  for line in reversed(prompt_text.splitlines()):
    starts = sorted({m.start() for p in START_PATTERNS for m in p.finditer(line)}, reverse=True)
    ends = sorted({m.end() for _, p in QUESTION_PATTERNS for m in p.finditer(line)})
    for start in starts:
      for end in (e for e in ends if e > start):
        try:
          return parse_problem(line[start:end])
        except ValueError:
          continue
  raise ValueError(f"no arithmetic problem in the prompt {prompt_text[-200:]!r}")


NUMBER = re.compile(r"(?<!\d)-?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?")
ANSWER_TAG = re.compile(r"answer\s*:", re.IGNORECASE)


def final_answer(completion: str) -> Fraction | None:
  """The completion's answer (see the module doc), or None if it holds no number."""
  tags = list(ANSWER_TAG.finditer(completion))
  after = NUMBER.search(completion, tags[-1].end()) if tags else None
  numbers = [after] if after else list(NUMBER.finditer(completion))[-1:]
  return Fraction(numbers[0].group(0).replace(",", "")) if numbers else None


# --- Splits and files ---


def is_heldout(equation: str) -> bool:
  """Whether problems of `equation` (Problem.equation) belong to the held-out split."""
  return int(hashlib.sha256(equation.encode("utf-8")).hexdigest(), 16) % HELDOUT_MODULUS == 0


def make_splits(seed: int, d: Difficulty, train: int, heldout: int
                ) -> tuple[list[Problem], list[Problem]]:
  """`train` and `heldout` distinct problems drawn from `seed`, each in the split its
  equation's hash names; ValueError if the difficulty has too few distinct problems to fill
  them."""
  rng, seen = random.Random(seed), set()
  out = {True: [], False: []}
  want = {True: heldout, False: train}
  for _ in range(20 * (train + heldout) + 1000):  # enough draws for any roomy difficulty
    if all(len(out[s]) >= want[s] for s in out):
      return out[False], out[True]
    p = make_problem(rng, d)
    if p is None or p.text in seen:
      continue
    seen.add(p.text)
    split = is_heldout(p.equation)
    if len(out[split]) < want[split]:
      out[split].append(p)
  raise ValueError(f"{d} gave only {len(out[False])} train and {len(out[True])} held-out "
                   f"distinct problems; ask for fewer or widen the difficulty")


def write_jsonl(path: str, problems: list[Problem]) -> None:
  with open(path, "w", encoding="utf-8", newline="\n") as f:
    f.writelines(json.dumps(p.record()) + "\n" for p in problems)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m align.arith", description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="folder for train.jsonl, heldout.jsonl, "
                                               "generator.json")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--train", type=int, default=2000)
  ap.add_argument("--heldout", type=int, default=300)
  ap.add_argument("--steps", type=int, default=Difficulty.steps)
  ap.add_argument("--max-operand", type=int, default=Difficulty.max_operand)
  ap.add_argument("--ops", default=Difficulty.ops)
  args = ap.parse_args(argv)
  d = Difficulty(args.steps, args.max_operand, args.ops)
  train, heldout = make_splits(args.seed, d, args.train, args.heldout)
  os.makedirs(args.out, exist_ok=True)
  write_jsonl(os.path.join(args.out, "train.jsonl"), train)
  write_jsonl(os.path.join(args.out, "heldout.jsonl"), heldout)
  meta = {"seed": args.seed, "difficulty": dataclasses.asdict(d), "train": len(train),
          "heldout": len(heldout), "instruction": INSTRUCTION}
  with open(os.path.join(args.out, "generator.json"), "w", encoding="utf-8") as f:
    f.write(json.dumps(meta, indent=1) + "\n")
  print(f"align.arith: {len(train)} train, {len(heldout)} held-out problems ({d}) -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
