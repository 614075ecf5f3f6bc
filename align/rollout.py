"""On-policy data: prompts -> completions sampled from the current policy -> training rows
(align/onpolicy.py's OnPolicyTask, what PPO and GRPO share, runs them each step).

Prompts (`align.{ppo,grpo}.prompts`), at most seq_len - max_new_tokens tokens each:
  chat   align/data.py records (hh-rlhf pairs, prompt/chosen/rejected, messages, {"prompt"}):
         the conversation before its last answer with the generation prompt (encode_chat),
         split by first user turn like the other alignment data; too long: the oldest turns
         go first (align.drop_turns), then the prompt is skipped
  text   train/data.py documents (data.text_key of .jsonl; .txt split on data.doc_separator,
         "\n": a prompt a line), encoded raw and cut to fit
A step's prompts are one global batch; each process takes a contiguous share of its rows
(prompt_dataset), so global row r is the same prompt whatever the process count.
`sample_rollout` samples completions into align/data.py's [B, T] layout, loss_mask 1 exactly
on the completion's targets (EOS included), on one inference Engine (infer/engine.py) whose
state is swapped for the current params: its jitted prefill/decode take params as an
argument, so they compile once per shape, never per step. Global row r of step s samples
with its own seed, a hash of (config.seed, s, r) (row_seeds): a resumed run samples what an
uninterrupted one would, and a run on many processes the same prompts with the same seeds as
a run on one (the same tokens on CPU; elsewhere up to the layout's floating-point differences).
"""

import dataclasses

import grain
import jax.numpy as jnp
import numpy as np
from flax import nnx

from align import datasets as ds_lib
from align.data import (
  BadRecord,
  DataReport,
  check_messages,
  empty_batch,
  encode_chat,
  pair_from_record,
  place_example,
  sft_from_record,
)
from align.logprobs import token_logps
from infer.engine import Engine
from infer.sampling import SamplingParams
from models.registry import model_inputs
from train import data as data_lib

PROMPT_FORMATS = ("chat", "text")
TRAIN, EVAL = 0, 1  # seed namespaces: training rollouts, evaluation rollouts


# --- Prompts ---


def prompt_messages(record) -> list[dict]:
  """The messages a chat record prompts with: up to (and ending with) its last user turn."""
  if isinstance(record, dict) and "chosen" in record and "rejected" in record:
    return list(pair_from_record(record).prompt)
  if isinstance(record, dict) and isinstance(record.get("prompt"), str) and \
      "response" not in record:
    if not record["prompt"].strip():
      raise BadRecord("missing_fields", "'prompt' must be a non-empty string")
    return [{"role": "user", "content": record["prompt"].strip()}]
  return sft_from_record(record)[:-1]  # the conversation before its last answer


def _chat_prompt(tokenizer, messages, max_prompt_len: int, drop_turns: bool):
  """(ids, dropped turns): too long a prompt drops its oldest (user, assistant) turns first
  (as align/data.tokenize_pair), keeping a system turn and the last user turn."""
  messages = check_messages(messages, end_role="user")
  system = messages[:1] if messages[0]["role"] == "system" else []
  turns, dropped = messages[len(system):], 0
  while True:
    ids, _ = encode_chat(tokenizer, system + turns, add_generation_prompt=True)
    if len(ids) <= max_prompt_len:
      return ids, dropped
    if not drop_turns or len(turns) == 1:
      raise BadRecord("too_long", f"prompt of {len(ids)} tokens > {max_prompt_len}")
    turns, dropped = turns[2:], dropped + 1


def load_prompt_split(data_cfg, tokenizer, split: str, max_prompt_len: int, fmt: str = "chat"):
  """(list of int32 prompt ids, DataReport) of one split. data_cfg: config.data's path,
  val_fraction, validation_path, text_key, doc_separator."""
  if fmt not in PROMPT_FORMATS:
    raise ValueError(f"prompts={fmt!r}; choose one of {PROMPT_FORMATS}")
  report, prompts = DataReport(), []
  if fmt == "text":
    paths, val_fraction = ds_lib.split_sources(data_cfg, split)
    docs = data_lib.read_documents(paths, text_key=data_cfg["text_key"],
                                   doc_separator=data_cfg["doc_separator"])
    if not data_cfg.get("validation_path"):
      docs = [] if split == "validation" and not val_fraction else \
          data_lib.split_documents(docs, split, val_fraction)
    for doc in docs:
      ids = tokenizer.encode(doc.strip())
      report.truncated += len(ids) > max_prompt_len
      prompts.append(np.asarray(ids[:max_prompt_len], np.int32))
      report.kept += 1
    return prompts, report
  for where, record in ds_lib.split_items(data_cfg, split, report):
    try:
      ids, dropped = _chat_prompt(tokenizer, prompt_messages(record), max_prompt_len,
                                  bool(data_cfg.get("drop_turns", True)))
    except BadRecord as e:
      report.skip(e, where)
      continue
    prompts.append(ids)
    report.kept += 1
    report.truncated += dropped > 0
  return prompts, report


def _prompt_row(ids, length: int) -> dict:
  return {"prompt_ids": np.pad(ids, (0, length - len(ids))).astype(np.int32),
          "prompt_len": np.int32(len(ids))}


def prompt_dataset(prompts, *, batch_size: int, max_prompt_len: int, split: str, seed: int,
                   process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """This process's rows of global batches of `batch_size` prompts: {"prompt_ids" int32
  [batch_size / process_count, max_prompt_len], "prompt_len" [batch_size / process_count]},
  rows [i * b, (i + 1) * b) of the global batch on process i. Train endless and shuffled,
  validation one pass padded with empty (length 0) prompts."""
  if batch_size % process_count:
    raise ValueError(f"prompt_dataset: {batch_size} prompts a batch do not split over "
                     f"{process_count} processes")
  prompts = list(prompts)
  if split == "validation":
    prompts += [np.zeros(0, np.int32)] * (-len(prompts) % batch_size)
    ds = grain.MapDataset.source(prompts)
  elif not prompts:
    raise ValueError("prompt_dataset: no training prompts")
  else:
    ds = grain.MapDataset.source(prompts).shuffle(seed=seed).repeat()
  b = batch_size // process_count
  # Every process batches the global stream and keeps its slice: cheap (prompt ids only),
  # and the global batch is the one-process batch, row for row.
  ds = ds.map(lambda ids: _prompt_row(ids, max_prompt_len)).batch(batch_size,
                                                                   drop_remainder=True)
  ds = ds.map(lambda rows: {k: v[process_index * b:(process_index + 1) * b]
                            for k, v in rows.items()})
  return ds.to_iter_dataset(ds_lib.IN_MEMORY_READ)


def row_seeds(seed: int, step: int, rows: int, namespace: int = TRAIN,
              start: int = 0) -> list[int]:
  """A uint32 sampling seed for each of global rows start ... start + rows - 1, a hash of
  (seed, namespace, step, row)."""
  return [int(np.random.SeedSequence([seed, namespace, step, r]).generate_state(1)[0])
          for r in range(start, start + rows)]


class Sampler:
  """Temperature sampling from changing params on one Engine (built at the first call)."""

  def __init__(self, graphdef, tokenizer, max_seq_len: int, max_batch: int):
    self.graphdef, self.tokenizer = graphdef, tokenizer
    self.max_seq_len, self.max_batch = max_seq_len, max_batch
    self.engine = None

  def __call__(self, params, prompts: list[list[int]], seeds: list[int], *,
               temperature: float, max_new_tokens: int):
    """infer.Results, one per prompt, sampled from the model `params` make."""
    if self.engine is None:
      self.engine = Engine(nnx.merge(self.graphdef, params), self.tokenizer, self.max_seq_len,
                           self.max_batch)
    self.engine.state = params  # same tree and shardings: the compiled steps are reused
    sampling = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=s)
                for s in seeds]
    return self.engine.generate(prompts, sampling)


@dataclasses.dataclass
class Rollout:
  """Sampled completions: `batch` [B, T] (align/data.py layout), texts for the rewards."""
  batch: dict
  prompt_texts: list[str]
  completion_texts: list[str]
  finish_reasons: list[str]

  @property
  def valid_B(self) -> np.ndarray:  # 1 for a real row, 0 for a padding prompt's
    return (self.batch["segment_ids"][:, 0] > 0).astype(np.float32)


def completion_batch(prompts, completions, seq_len: int) -> dict:
  """[B, T] rows of prompt + completion ids (a None completion: an all-0 padding row);
  loss_mask 1 on the completion's targets."""
  batch = empty_batch(len(prompts), seq_len)
  for b, (prompt, completion) in enumerate(zip(prompts, completions)):
    if completion is None:
      continue
    ids = np.asarray(list(prompt) + list(completion), np.int32)
    mask = np.asarray([0] * len(prompt) + [1] * len(completion), np.int32)
    if len(ids) - 1 > seq_len:
      raise ValueError(f"row {b}: prompt + completion = {len(ids)} tokens > seq_len + 1")
    place_example(batch, b, 0, 1, ids, mask)
  return batch


def sample_rollout(sampler: Sampler, params, prompt_batch: dict, seeds: list[int], *,
                   seq_len: int, temperature: float, max_new_tokens: int,
                   repeat: int = 1) -> Rollout:
  """Samples `repeat` completions of each prompt of a prompt batch (consecutive rows: prompt
  b gives rows b*repeat ... b*repeat + repeat - 1); one seed per row."""
  ids_BT, len_B = np.asarray(prompt_batch["prompt_ids"]), np.asarray(prompt_batch["prompt_len"])
  prompts = [ids_BT[b, :len_B[b]].tolist() for b in range(len(len_B)) for _ in range(repeat)]
  real = [len(p) > 0 for p in prompts]
  dummy = [sampler.tokenizer.eos_id or 0]  # padding prompts: sampled for a fixed shape, unused
  results = sampler(params, [p if ok else dummy for p, ok in zip(prompts, real)], seeds,
                    temperature=temperature, max_new_tokens=max_new_tokens)
  batch = completion_batch(prompts, [r.token_ids if ok else None for r, ok in zip(results, real)],
                           seq_len)
  decode = sampler.tokenizer.decode
  return Rollout(batch, [decode(p) if p else "" for p in prompts],
                 [r.text if ok else "" for r, ok in zip(results, real)],
                 [r.finish_reason for r in results])


def policy_forward(model, batch, temperature: float):
  """(x_BTD hidden states, logits_BTV / temperature): the distribution that was sampled
  (temperature 0, greedy, keeps the raw logits)."""
  x_BTD = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"],
                       **model_inputs(model.cfg, batch))
  logits_BTV = model.unembed(x_BTD)  # one forward for logits and a value head's input
  if temperature > 0:
    logits_BTV = logits_BTV / jnp.asarray(temperature, logits_BTV.dtype)
  return x_BTD, logits_BTV


def completion_logps(logits_BTV, batch, mask_BT):
  """token_logps_BT of the targets, exactly 0 off the completion."""
  return jnp.where(mask_BT > 0, token_logps(logits_BTV, batch["targets"]), 0.0)
