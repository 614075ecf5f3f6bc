"""Self-Instruct's text side: prompts, parsers and filters (Wang et al. 2022).

Everything here is pure text, no model, so each piece is tested on fixed strings:
  encode_prompt / parse_tasks      the "Come up with a series of tasks:" list prompt and its
                                   continuation, one task a line ("Task N: ...")
  heuristic_reason                 the paper's filters: <= 3 or > 150 words, keyword blocklist,
                                   "Write a program", starting with punctuation / non-ASCII
  RougePool                        ROUGE-L (rouge-score, no stemmer) against every pooled
                                   instruction; > 0.7 is a near-duplicate
  clf_prompt / parse_clf           "Can the following task be regarded as a classification
                                   task with finite output labels?" with few-shot examples
  input_first_prompt, output_first_prompt, parse_*_instances, clean_instances
                                   instance generation and its invalid / duplicate filters
"""

import collections
import re
import string

from rouge_score import rouge_scorer, tokenizers

MIN_WORDS, MAX_WORDS = 3, 150  # kept iff MIN_WORDS < words <= MAX_WORDS
# The paper's list (its code adds the plurals); whole words, any case.
BLOCKLIST = ("image", "images", "graph", "graphs", "picture", "pictures", "file", "files", "map",
             "maps", "draw", "plot", "go to")
_BLOCK_RE = re.compile(r"\b(" + "|".join(re.escape(w) for w in BLOCKLIST) + r")\b", re.I)
TASK_HEADER = "Come up with a series of tasks:\n\n"
_TASK_LINE_RE = re.compile(r"^\s*Task\s*(\d+)\s*:\s?(.*)$")
HEURISTIC_REASONS = ("too_short", "too_long", "blocklist", "write_a_program",
                     "starts_with_punctuation", "starts_with_non_ascii")


def one_line(text: str) -> str:
  return re.sub(r"\s+", " ", text).strip()


# --- Instruction generation ---


def encode_prompt(instructions: list[str]) -> str:
  """The paper's prompt: the tasks numbered from 1, ending with the next number so the
  model continues the list."""
  if not instructions:
    raise ValueError("encode_prompt needs at least one instruction")
  lines = [f"Task {i}: {one_line(t).rstrip(':')}\n" for i, t in enumerate(instructions, 1)]
  return TASK_HEADER + "".join(lines) + f"Task {len(instructions) + 1}:"


def parse_tasks(text: str, first: int, finish_reason: str) -> tuple[list[str], str]:
  """(instructions, how the list ended) from the continuation of `encode_prompt`.

  The continuation starts inside task `first`. Each task is one line (the prompt puts every
  task on one line); the next line must be "Task first+1:", and so on. The list ends at the
  first line that is not the next task ("off_format"), at the end of the text ("complete"),
  or, when generation hit max_tokens ("length") inside the last line, that task is cut and
  dropped, as the paper drops truncated output.
  """
  lines = text.split("\n")
  whole = len(lines) > 1 and lines[-1] == ""  # ends with a newline: the last task is whole
  if whole:
    lines.pop()
  tasks, ended = [lines[0]], "complete"
  for line in lines[1:]:
    m = _TASK_LINE_RE.match(line)
    if m is None or int(m.group(1)) != first + len(tasks):
      ended = "off_format"
      break
    tasks.append(m.group(2))
  if finish_reason == "length" and ended == "complete" and not whole:
    tasks, ended = tasks[:-1], "length"
  tasks = [t[:1].upper() + t[1:] for t in (one_line(t) for t in tasks)]
  return [t for t in tasks if t], ended


def heuristic_reason(instruction: str) -> str | None:
  """The first of the paper's rule filters that rejects `instruction`, or None."""
  words = len(instruction.split())
  if words <= MIN_WORDS:
    return "too_short"
  if words > MAX_WORDS:
    return "too_long"
  if _BLOCK_RE.search(instruction):
    return "blocklist"
  if instruction.startswith("Write a program"):
    return "write_a_program"
  if instruction[0] in string.punctuation:
    return "starts_with_punctuation"
  if not instruction[0].isascii():
    return "starts_with_non_ascii"
  return None


class RougePool:
  """The pooled instructions, and each candidate's highest ROUGE-L F1 against them.

  Scores are rouge-score's own (RougeScorer(["rougeL"], use_stemmer=False): its tokenizer,
  its LCS). Its LCS is pure Python, so pairs are visited in order of an upper bound,
  F1 <= 2 * |bag overlap| / (|a| + |b|), and the search stops once the bound cannot beat
  the best exact score: the same maximum at a fraction of the LCS calls.
  """

  def __init__(self, instructions=()):
    # The scorer's own tokenizer (what RougeScorer(use_stemmer=False) builds), kept here to
    # tokenize each text once.
    self.tokenizer = tokenizers.DefaultTokenizer(use_stemmer=False)
    self.scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=self.tokenizer)
    self.texts: list[str] = []
    self.tokens: list[list[str]] = []
    self.bags: list[collections.Counter] = []
    for t in instructions:
      self.add(t)

  def tokenize(self, text: str) -> list[str]:
    return self.tokenizer.tokenize(text)

  def add(self, text: str) -> None:
    self.texts.append(text)
    self.tokens.append(self.tokenize(text))
    self.bags.append(collections.Counter(self.tokens[-1]))

  def max_score(self, text: str) -> tuple[float, str | None]:
    """(highest ROUGE-L F1 against the pool, the pooled text that has it)."""
    toks = self.tokenize(text)
    bag = collections.Counter(toks)
    bounds = []
    for i, other in enumerate(self.bags):
      total = len(toks) + len(self.tokens[i])
      if total:
        bounds.append((2 * sum((bag & other).values()) / total, i))
    bounds.sort(reverse=True)
    best, best_i = 0.0, None
    score_lcs = rouge_scorer._score_lcs  # noqa: SLF001 rouge-score's LCS of token lists, not public
    for bound, i in bounds:
      if bound <= best:
        break
      f = score_lcs(self.tokens[i], toks).fmeasure
      if f > best:
        best, best_i = f, i
    return best, (self.texts[best_i] if best_i is not None else None)


# --- Classification-task detection ---

CLF_QUESTION = ("Can the following task be regarded as a classification task with finite "
                "output labels?\n\n")


def clf_prompt(examples: list[tuple[str, bool]], instruction: str) -> str:
  """The paper's few-shot question; `examples` are (instruction, is_classification)."""
  shots = "".join(f"Task: {one_line(t)}\nIs it classification? {'Yes' if y else 'No'}\n\n"
                  for t, y in examples)
  return CLF_QUESTION + shots + f"Task: {one_line(instruction)}\nIs it classification?"


def parse_clf(text: str) -> bool | None:
  """True for "Yes", False for "No" (first word, any case), None for anything else."""
  m = re.match(r"\s*([A-Za-z]+)", text)
  word = m.group(1).lower() if m else ""
  return {"yes": True, "no": False}.get(word)


# --- Instance generation ---

INPUT_FIRST_HEADER = ("Come up with examples for the following tasks. Try to generate multiple "
                      "examples when possible. If the task doesn't require additional input, "
                      "you can generate the output directly.\n\n")
OUTPUT_FIRST_HEADER = ("Given the classification task definition and the class labels, generate "
                       "an input that corresponds to each of the class labels. If the task "
                       "doesn't require input, just generate possible class labels.\n\n")


def input_first_prompt(demos: list[dict], instruction: str) -> str:
  """Non-classification tasks: the input first, then its output. `demos` are seed tasks
  {instruction, instances[{input, output}]}."""
  parts = [INPUT_FIRST_HEADER]
  for d in demos:
    parts.append(f"Task: {one_line(d['instruction'])}\n")
    for k, inst in enumerate(d["instances"], 1):
      if inst["input"].strip():
        parts.append(f"Example {k}\nInput: {inst['input'].strip()}\n")
      parts.append(f"Output: {inst['output'].strip()}\n")
    parts.append("\n")
  return "".join(parts) + f"Task: {one_line(instruction)}\n"


def output_first_prompt(demos: list[dict], instruction: str) -> str:
  """Classification tasks: the class label first, then an input that has it."""
  parts = [OUTPUT_FIRST_HEADER]
  for d in demos:
    parts.append(f"Task: {one_line(d['instruction'])}\n")
    for inst in d["instances"]:
      parts.append(f"Class label: {inst['output'].strip()}\n")
      if inst["input"].strip():
        parts.append(f"Input: {inst['input'].strip()}\n")
    parts.append("\n")
  return "".join(parts) + f"Task: {one_line(instruction)}\n"


def _input_output(text: str) -> tuple[str, str]:
  """(input, output) of one example: the text before / after "Output:" ("Output N:")."""
  parts = re.split(r"Output\s*\d*\s*:", text, maxsplit=1)
  inp, out = (parts[0], parts[1]) if len(parts) == 2 else ("", text)
  out = re.split(r"Input\s*\d*\s*:", out)[0]  # a second example glued on
  inp = re.sub(r"^\s*Input\s*\d*\s*:", "", inp)
  return inp.strip(), out.strip()


def parse_gen_instances(text: str, finish_reason: str) -> list[tuple[str, str]] | None:
  """(input, output) pairs of an input-first response; None if it has no example at all."""
  text = text.strip()
  if re.search(r"Example\s?\d*\.?", text):
    chunks = [c for c in re.split(r"Example\s?\d*\.?", text) if c.strip()]
  elif re.search(r"Output\s*\d*\s*:", text):
    chunks = [text]
  else:
    return None
  pairs = [_input_output(c) for c in chunks]
  return pairs[:-1] if finish_reason == "length" else pairs


def parse_clf_instances(text: str, finish_reason: str) -> list[tuple[str, str]] | None:
  """(input, label) pairs of an output-first response; None without a "Class label:"."""
  if "Class label:" not in text:
    return None
  pairs = []
  for chunk in text.split("Class label:")[1:]:
    label, _, rest = chunk.strip().partition("\n")
    pairs.append((re.sub(r"^\s*Input\s*\d*\s*:", "", rest).strip(), label.strip()))
  return pairs[:-1] if finish_reason == "length" else pairs


INSTANCE_REASONS = ("request_refused", "parse_failure", "truncated", "empty_output", "output_equals_input",
                    "ends_with_colon", "same_input_different_output", "duplicate", "over_limit")


def clean_instances(pairs: list[tuple[str, str]], limit: int) -> tuple[list[tuple[str, str]],
                                                                        collections.Counter]:
  """(kept pairs, rejections by reason): the paper's invalid filters (empty output, output ==
  input, a field ending in ":" = cut off), then duplicates; if one non-empty input has two
  different outputs the task's instances are all dropped (the paper's rule); then the first
  `limit` (the paper keeps at most 5 per task)."""
  rejected = collections.Counter()
  valid = []
  for inp, out in pairs:
    if not out:
      rejected["empty_output"] += 1
    elif inp == out:
      rejected["output_equals_input"] += 1
    elif inp.endswith(":") or out.endswith(":"):
      rejected["ends_with_colon"] += 1
    else:
      valid.append((inp, out))
  outputs = collections.defaultdict(set)
  for inp, out in valid:
    if inp:
      outputs[inp].add(out)
  if any(len(o) > 1 for o in outputs.values()):
    rejected["same_input_different_output"] += len(valid)
    return [], rejected
  unique = list(dict.fromkeys(valid))
  rejected["duplicate"] += len(valid) - len(unique)
  rejected["over_limit"] += max(0, len(unique) - limit)
  return unique[:limit], rejected
