"""Alignment data: records -> chat messages -> token ids with response masks -> batches.

Records (JSONL, one object a line; `.jsonl.gz` too):
  SFT          {"messages": [{"role", "content"}, ...]} or {"prompt": str, "response": str}
               or an hh-rlhf record (its "chosen" transcript)
  preference   {"chosen": hh, "rejected": hh} (Anthropic hh-rlhf: "\\n\\nHuman: ...\\n\\nAssistant: ..."
               transcripts sharing all but the last assistant turn), or
               {"prompt": str | messages, "chosen": str, "rejected": str}
Roles are "system" (first only), "user", "assistant"; user and assistant alternate.

Rendering (`encode_chat`, `render`): the tokenizer's chat template when it has one, else a
plain format:  "System: {c}\\n" "User: {c}\\n" "Assistant:" " {c}" EOS "\\n" ...
(the space after "Assistant:" belongs to the response: BPE vocabularies merge a word with
its leading space). Every assistant turn is trained as encode(content) + [EOS], so the
model learns to stop; a template must close an assistant turn with the EOS token's text.

Rows: a tokenized example is (ids_N, mask_N), mask 1 on the response tokens (targets). A row
feeds the model ids[:-1] and predicts ids[1:], so an example fits `max_len` = T, the batch
length, iff N - 1 <= T. Too long: SFT conversations (`tokenize_sft_turns`) and preference
pairs drop their oldest whole (user, assistant) turns first (never part of a turn, never the
last exchange) and are skipped only if still too long; both are counted in the DataReport.

Bad records are skipped and counted by reason (REASONS), never trained on, never a crash
mid-way; `DataReport.check` refuses a dataset that is mostly garbage.
"""

import collections
import dataclasses
import re
from typing import Iterable, Sequence

import numpy as np

from train.data import iter_jsonl, resolve_paths

REASONS = ("missing_fields", "unparseable", "prompt_mismatch", "empty_response",
           "identical_pair", "too_long")
ROLES = ("system", "user", "assistant")
PLAIN_PREFIX = {"system": "System: ", "user": "User: "}
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


class BadRecord(ValueError):
  """A record that cannot be used; `reason` is one of REASONS."""

  def __init__(self, reason: str, detail: str):
    assert reason in REASONS, reason
    super().__init__(f"{reason}: {detail}")
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: tuple  # messages, ending with a user turn
  chosen: str
  rejected: str


@dataclasses.dataclass
class DataReport:
  """Kept and skipped counts; `truncated` pairs were kept after dropping their oldest turns."""
  kept: int = 0
  truncated: int = 0
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  samples: dict = dataclasses.field(default_factory=dict)  # reason -> first few "where: why"

  def skip(self, err: BadRecord, where: str) -> None:
    self.skipped[err.reason] += 1
    self.samples.setdefault(err.reason, [])
    if len(self.samples[err.reason]) < 3:
      self.samples[err.reason].append(f"{where}: {err}")

  @property
  def total(self) -> int:
    return self.kept + sum(self.skipped.values())

  def as_dict(self) -> dict:
    return {"kept": self.kept, "truncated": self.truncated, "total": self.total,
            **{f"skipped/{r}": self.skipped[r] for r in REASONS}}

  def check(self, max_skipped_fraction: float = 0.5) -> None:
    """Raises when nothing is left or more than the given fraction was skipped."""
    skipped = sum(self.skipped.values())
    if self.kept == 0 or skipped > max_skipped_fraction * self.total:
      raise ValueError(f"data: kept {self.kept} of {self.total} records (skipped "
                       f"{dict(self.skipped)}; e.g. {self.samples}); refusing to train on this")


# --- Records -> messages ---


def _message(m, where: str) -> dict:
  if not isinstance(m, dict) or not isinstance(m.get("content"), str) or \
      m.get("role") not in ROLES:
    raise BadRecord("unparseable", f"{where} is not a {{'role': {ROLES}, 'content': str}} message")
  return {"role": m["role"], "content": m["content"].strip()}


def check_messages(messages: Sequence[dict], end_role: str) -> list[dict]:
  """Validated copies: optional system first, then user/assistant alternating from user,
  ending with `end_role`; only the last turn may be empty (reported as empty_response)."""
  msgs = [_message(m, f"message {i}") for i, m in enumerate(messages)]
  body = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
  for i, m in enumerate(body):
    if m["role"] != ("user", "assistant")[i % 2]:
      raise BadRecord("unparseable", f"turn {i} is {m['role']!r}: user and assistant turns "
                      "must alternate, starting with user")
    if not m["content"] and not (i == len(body) - 1 and end_role == "assistant"):
      raise BadRecord("unparseable", f"turn {i} ({m['role']}) is empty")
  if not body or body[-1]["role"] != end_role:
    raise BadRecord("unparseable", f"the conversation must end with a {end_role} turn")
  if end_role == "assistant" and not body[-1]["content"]:
    raise BadRecord("empty_response", "the last assistant turn is empty")
  return msgs


def parse_hh(text) -> list[dict]:
  """An hh-rlhf transcript "\\n\\nHuman: a\\n\\nAssistant: b..." -> messages (content stripped)."""
  if not isinstance(text, str):
    raise BadRecord("missing_fields", f"transcript is a {type(text).__name__}, not a string")
  parts = _HH_TURN.split(text)
  if parts[0].strip() or len(parts) < 3:
    raise BadRecord("unparseable", "transcript does not start with '\\n\\nHuman:'")
  roles = {"Human": "user", "Assistant": "assistant"}
  return [{"role": roles[r], "content": c.strip()} for r, c in zip(parts[1::2], parts[2::2])]


def _response(value, name: str) -> str:
  """A response given as text or as [{"role": "assistant", "content": ...}]."""
  if isinstance(value, list) and len(value) == 1:
    value = _message(value[0], name)["content"]
  if not isinstance(value, str):
    raise BadRecord("missing_fields", f"{name!r} must be a string")
  if not value.strip():
    raise BadRecord("empty_response", f"{name!r} is empty")
  return value.strip()


def pair_from_record(record) -> Pair:
  """A preference record (hh-rlhf transcripts or prompt/chosen/rejected) -> Pair."""
  if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
    raise BadRecord("missing_fields", "a preference record needs 'chosen' and 'rejected'")
  if "prompt" in record:
    prompt = record["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(prompt, list):
      raise BadRecord("missing_fields", "'prompt' must be a string or a list of messages")
    prompt = check_messages(prompt, end_role="user")
    chosen, rejected = _response(record["chosen"], "chosen"), _response(record["rejected"],
                                                                          "rejected")
  else:
    c, r = parse_hh(record["chosen"]), parse_hh(record["rejected"])
    if c[:-1] != r[:-1]:
      raise BadRecord("prompt_mismatch", "chosen and rejected differ before the last turn")
    prompt = check_messages(c[:-1], end_role="user")
    chosen = check_messages(c, end_role="assistant")[-1]["content"]
    rejected = check_messages(r, end_role="assistant")[-1]["content"]
  if chosen == rejected:
    raise BadRecord("identical_pair", "chosen == rejected")
  return Pair(tuple(prompt), chosen, rejected)


def sft_from_record(record) -> list[dict]:
  """An SFT record ({"messages"}, {"prompt", "response"} or hh-rlhf {"chosen"}) -> messages
  ending with assistant."""
  if isinstance(record, dict) and isinstance(record.get("messages"), list):
    return check_messages(record["messages"], end_role="assistant")
  if isinstance(record, dict) and "prompt" in record and "response" in record:
    if not isinstance(record["prompt"], str) or not record["prompt"].strip():
      raise BadRecord("missing_fields", "'prompt' must be a non-empty string")
    return [{"role": "user", "content": record["prompt"].strip()},
            {"role": "assistant", "content": _response(record["response"], "response")}]
  if isinstance(record, dict) and isinstance(record.get("chosen"), str):
    # An hh-rlhf preference record: its chosen transcript is a demonstration.
    return check_messages(parse_hh(record["chosen"]), end_role="assistant")
  raise BadRecord("missing_fields", "an SFT record needs 'messages', 'prompt' and 'response', "
                  "or an hh-rlhf 'chosen' transcript")


# --- Messages -> token ids and response masks ---


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
  """The conversation as text: the chat template, or the plain format (its EOS ids exist
  only in `encode_chat`'s ids, so build model inputs with that, not with this text)."""
  if tokenizer.chat_template:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt)
  text = "".join(PLAIN_PREFIX[m["role"]] + m["content"] + "\n" if m["role"] != "assistant"
                 else f"Assistant: {m['content']}\n" for m in messages)
  return text + ("Assistant:" if add_generation_prompt else "")


def _chunks(tokenizer, messages, add_generation_prompt):
  """[(text, is_response)]: prompt text between responses, each response's content."""
  if not tokenizer.chat_template:
    out = []
    for m in messages:
      sep = "\n" if out and out[-1][1] else ""  # closes the previous assistant turn
      if m["role"] == "assistant":
        out += [(sep + "Assistant:", False), (" " + m["content"], True)]
      else:
        out.append((sep + PLAIN_PREFIX[m["role"]] + m["content"] + "\n", False))
    if add_generation_prompt:
      out.append((("\n" if out and out[-1][1] else "") + "Assistant:", False))
    return out
  eos_text = tokenizer.token_text(tokenizer.eos_id)
  out, done = [], ""
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt = tokenizer.apply_chat_template(list(messages[:i]), True)
    full = tokenizer.apply_chat_template(list(messages[:i + 1]), False)
    if not prompt.startswith(done) or not full.startswith(prompt + m["content"] + eos_text):
      raise ValueError("the chat template must render an assistant turn as the generation "
                       f"prompt + content + the EOS token {eos_text!r}; it does not")
    out += [(prompt[len(done):], False), (m["content"], True)]
    done = prompt + m["content"] + eos_text
  if add_generation_prompt or messages[-1]["role"] != "assistant":
    tail = tokenizer.apply_chat_template(list(messages), add_generation_prompt)
    if not tail.startswith(done):
      raise ValueError("the chat template renders earlier turns differently once later turns "
                       "follow; responses cannot be masked against it")
    out.append((tail[len(done):], False))
  return out


def encode_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False):
  """(ids_N, mask_N) int32: mask 1 on every assistant turn's tokens, content + EOS. A row
  ending in an assistant turn ends at its EOS."""
  if tokenizer.eos_id is None:
    raise ValueError("alignment data needs a tokenizer with an EOS id (responses end with it)")
  bos_text = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else None
  ids, mask = [], []
  for text, is_response in _chunks(tokenizer, messages, add_generation_prompt):
    first = not ids
    # The tokenizer's default BOS goes once, at the start, unless the template wrote it.
    add_bos = None if first and not (bos_text and text.startswith(bos_text)) else False
    piece = tokenizer.encode(text, add_bos=add_bos) + ([tokenizer.eos_id] if is_response else [])
    ids += piece
    mask += [int(is_response)] * len(piece)
  return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def _check_fits(ids_N, max_len: int) -> None:
  if len(ids_N) - 1 > max_len:
    raise BadRecord("too_long", f"{len(ids_N)} tokens, more than max_len + 1 = {max_len + 1}")


def tokenize_sft(tokenizer, messages: Sequence[dict], max_len: int):
  """(ids_N, mask_N) over all assistant turns; BadRecord("too_long") if N - 1 > max_len."""
  ids, mask = encode_chat(tokenizer, check_messages(messages, end_role="assistant"))
  _check_fits(ids, max_len)
  return ids, mask


def tokenize_sft_turns(tokenizer, messages: Sequence[dict], max_len: int):
  """(ids_N, mask_N, dropped): as tokenize_sft, but a conversation too long drops its oldest
  whole (user, assistant) turns first (keeping a system turn and the last exchange)."""
  messages = check_messages(messages, end_role="assistant")
  system = messages[:1] if messages[0]["role"] == "system" else []
  turns, dropped = messages[len(system):], 0
  while True:
    try:
      return (*tokenize_sft(tokenizer, system + turns, max_len), dropped)
    except BadRecord:
      if len(turns) <= 2:
        raise
      turns, dropped = turns[2:], dropped + 1


def tokenize_pair(tokenizer, prompt: Sequence[dict], chosen: str, rejected: str,
                  max_len: int, drop_turns: bool = True):
  """((ids, mask) chosen, (ids, mask) rejected, dropped turns): identical prompt ids, mask 1
  on the final response only. Too long: drop the oldest (user, assistant) turns if allowed."""
  prompt = check_messages(prompt, end_role="user")
  system = prompt[:1] if prompt[0]["role"] == "system" else []
  turns, dropped = prompt[len(system):], 0
  while True:
    rows = []
    for response in (chosen, rejected):
      msgs = system + turns + [{"role": "assistant", "content": response}]
      ids, mask = encode_chat(tokenizer, msgs)
      mask = mask * (np.arange(len(mask)) >= len(mask) - _last_run(mask))  # final turn only
      rows.append((ids, mask))
    try:
      for ids, _ in rows:
        _check_fits(ids, max_len)
      return rows[0], rows[1], dropped
    except BadRecord:
      if not drop_turns or len(turns) == 1:
        raise
      turns, dropped = turns[2:], dropped + 1


def _last_run(mask_N) -> int:
  """Length of the final run of ones (the last response, content + EOS)."""
  zeros = np.flatnonzero(mask_N == 0)
  return len(mask_N) - (zeros[-1] + 1 if len(zeros) else 0)


# --- Reading files ---


def read_records(paths: str | Sequence[str], report: DataReport) -> Iterable[tuple[str, object]]:
  """(where, record) for each line of .jsonl(.gz) files; bad JSON is counted, not raised."""
  for path in resolve_paths(paths):
    def bad(line_no, message, path=path):
      report.skip(BadRecord("unparseable", message), f"{path}:{line_no}")

    for line_no, record in iter_jsonl(path, on_bad_json=bad):
      yield f"{path}:{line_no}", record


def tokenize_pairs(records, report: DataReport, tokenizer, max_len: int,
                   drop_turns: bool = True) -> list:
  """(chosen row, rejected row) of each usable (where, record); the rest are counted."""
  pairs = []
  for where, record in records:
    try:
      p = pair_from_record(record)
      chosen, rejected, dropped = tokenize_pair(tokenizer, p.prompt, p.chosen, p.rejected,
                                                max_len, drop_turns)
    except BadRecord as e:
      report.skip(e, where)
      continue
    pairs.append((chosen, rejected))
    report.kept += 1
    report.truncated += dropped > 0
  return pairs


def tokenize_sft_records(records, report: DataReport, tokenizer, max_len: int,
                         drop_turns: bool = False) -> list:
  """(ids, mask) of each usable (where, record); the rest are counted. `drop_turns`: a
  conversation too long drops its oldest exchanges first (tokenize_sft_turns)."""
  examples = []
  for where, record in records:
    try:
      messages = sft_from_record(record)
      if drop_turns:
        ids, mask, dropped = tokenize_sft_turns(tokenizer, messages, max_len)
      else:
        (ids, mask), dropped = tokenize_sft(tokenizer, messages, max_len), 0
    except BadRecord as e:
      report.skip(e, where)
      continue
    examples.append((ids, mask))
    report.kept += 1
    report.truncated += dropped > 0
  return examples


def load_pairs(paths, tokenizer, max_len: int, drop_turns: bool = True):
  """(list of (chosen row, rejected row), DataReport) from preference JSONL files."""
  report = DataReport()
  return tokenize_pairs(read_records(paths, report), report, tokenizer, max_len,
                        drop_turns), report


def load_sft(paths, tokenizer, max_len: int):
  """(list of (ids, mask), DataReport) from SFT JSONL files."""
  report = DataReport()
  return tokenize_sft_records(read_records(paths, report), report, tokenizer, max_len), report


# --- Batches ---

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def place_example(batch, row: int, start: int, segment: int, ids_N, mask_N) -> None:
  """Writes one example's N ids (N - 1 inputs/targets) into `batch` row `row` from column
  `start`, as segment `segment` with positions from 0."""
  n = len(ids_N) - 1
  cols = slice(start, start + n)
  batch["inputs"][row, cols], batch["targets"][row, cols] = ids_N[:-1], ids_N[1:]
  batch["segment_ids"][row, cols] = segment
  batch["positions"][row, cols] = np.arange(n)
  batch["loss_mask"][row, cols] = mask_N[1:]


def empty_batch(rows: int, seq_len: int) -> dict:
  """Every FIELDS array [rows, seq_len] int32, all 0 (padding)."""
  return {k: np.zeros((rows, seq_len), np.int32) for k in FIELDS}


def pack_sft(examples: Sequence[tuple], seq_len: int) -> dict:
  """First-fit packing into [R, T] rows: each example one whole segment (ids 1, 2, ... in a
  row, positions from 0); 0 pads every field. An example longer than T + 1 ids raises."""
  used, placed = [], []  # per row: filled columns; (row, start, segment, example)
  for i, (ids, mask) in enumerate(examples):
    n = len(ids) - 1
    if not 1 <= n <= seq_len:
      raise ValueError(f"example {i}: {len(ids)} tokens do not fit seq_len={seq_len} "
                       "(need 2 to seq_len + 1)")
    row = next((r for r, u in enumerate(used) if u + n <= seq_len), len(used))
    if row == len(used):
      used.append(0)
    segment = 1 + sum(1 for p in placed if p[0] == row)
    placed.append((row, used[row], segment, ids, mask))
    used[row] += n
  batch = empty_batch(len(used), seq_len)
  for row, start, segment, ids, mask in placed:
    place_example(batch, row, start, segment, ids, mask)
  return batch


def pair_batch(pairs: Sequence[tuple], seq_len: int) -> dict:
  """[2B, T] batch: row b is pair b's chosen response, row B + b its rejected one (one
  segment each, right-padded), so one forward pass scores both."""
  batch = empty_batch(2 * len(pairs), seq_len)
  for b, (chosen, rejected) in enumerate(pairs):
    for row, (ids, mask) in ((b, chosen), (len(pairs) + b, rejected)):
      if not 1 <= len(ids) - 1 <= seq_len:
        raise ValueError(f"pair {b}: {len(ids)} tokens do not fit seq_len={seq_len}")
      place_example(batch, row, 0, 1, ids, mask)
  return batch
