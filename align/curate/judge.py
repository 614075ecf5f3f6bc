"""A teacher model as judge: which of two responses to a prompt is better, and how sure.

Any meshlm decoder can judge (SmolLM2-135M-Instruct by default; a run's own earlier
checkpoint works too: `infer.loading.load_any` loads either). Two ways:

- pairwise (`PairwiseJudge`): the teacher reads a written rubric, the conversation and two
  responses, and the assistant turn is prefilled up to the verdict ("... is Response"),
  so the next token is " A" or " B". p(A) = P(" A") / (P(" A") + P(" B")). Each pair is
  judged in both orders and the two are averaged, p = (p_AB + 1 - p_BA) / 2, which cancels
  position bias exactly: swapping the candidates gives 1 - p. If the teacher puts less
  than `min_mass` of its probability on the two verdict tokens (in either order) its
  verdict is "unparsable": it did not answer the question it was asked.
- reward (`RewardJudge`): a `meshlm rm` workdir scores each response; p = sigmoid(r_A - r_B).

Confidence is |2p - 1| after temperature calibration (p's logit divided by a temperature
fitted on pairs with known answers, `fit_temperature`), so a confidence of 0.6 means about
80% right on data like the calibration set. `agree` says whether the two orders agreed.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from align.data import encode_chat
from align.rewards import RewardModelScorer
from align.rollout import Rollout, completion_batch
from train.workdir import load_tokenizer

RUBRIC = (
    "You are a careful reviewer comparing two assistant responses to the same conversation. "
    "The better response answers the user's last message helpfully and correctly, stays on "
    "topic, is honest about what it does not know, and refuses only requests that are "
    "harmful. Ignore length and style unless they hurt the answer.")

QUESTION = ("[Conversation]\n{prompt}\n\n[Response A]\n{a}\n\n[Response B]\n{b}\n\n"
            "Which response is better, A or B?")
PREFILL = "The better response is Response"
VERDICTS = (" A", " B")


@dataclasses.dataclass(frozen=True)
class Judgement:
  """verdict: "A" or "B" (in the order given) or "unparsable"; p_a: debiased P(A better),
  calibrated; confidence: |2 p_a - 1| (0 when unparsable); agree: both orders chose the
  same response; p_ab, p_ba: P(the first-shown response is better) in each order;
  mass: the smaller verdict-token mass of the two orders."""
  verdict: str
  p_a: float
  confidence: float
  agree: bool
  p_ab: float
  p_ba: float
  mass: float

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def combine(p_ab: float, p_ba: float, mass: float, *, temperature: float = 1.0,
            min_mass: float = 0.0) -> Judgement:
  """The debiased, calibrated judgement from the two orders' P(first shown is better)."""
  p = 0.5 * (p_ab + 1.0 - p_ba)
  agree = (p_ab > 0.5) == (p_ba < 0.5) and p_ab != 0.5 and p_ba != 0.5
  if mass < min_mass or not math.isfinite(p):
    return Judgement("unparsable", 0.5, 0.0, False, p_ab, p_ba, mass)
  p_cal = calibrate(p, temperature)
  verdict = "A" if p_cal > 0.5 else "B" if p_cal < 0.5 else "tie"
  return Judgement(verdict, p_cal, abs(2.0 * p_cal - 1.0), agree, p_ab, p_ba, mass)


def _logit(p: float) -> float:
  p = min(max(p, 1e-12), 1.0 - 1e-12)
  return math.log(p) - math.log1p(-p)


def calibrate(p: float, temperature: float) -> float:
  return 1.0 / (1.0 + math.exp(-_logit(p) / temperature))


def fit_temperature(p_B: np.ndarray, truth_B: np.ndarray) -> float:
  """The temperature T minimising the log loss of sigmoid(logit(p)/T) against truth (1: the
  first response is really better); a 1-D grid then golden-section search, T in [0.05, 20]."""
  z = np.array([_logit(float(p)) for p in p_B])
  y = np.asarray(truth_B, np.float64)
  if len(z) == 0 or not np.isin(y, (0.0, 1.0)).all():
    raise ValueError("fit_temperature needs at least one pair with a 0/1 answer")

  def nll(log_t):
    q = 1.0 / (1.0 + np.exp(-z / math.exp(log_t)))
    q = np.clip(q, 1e-12, 1 - 1e-12)
    return -np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))

  grid = np.linspace(math.log(0.05), math.log(20.0), 61)
  best = int(np.argmin([nll(g) for g in grid]))
  lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
  ratio = (math.sqrt(5) - 1) / 2
  for _ in range(40):
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    lo, hi = (lo, b) if nll(a) < nll(b) else (a, hi)
  return float(math.exp(0.5 * (lo + hi)))


def expected_calibration_error(p_B, truth_B, buckets: int = 10) -> float:
  """ECE of the verdict: confidence max(p, 1-p) against whether the verdict was right."""
  p = np.asarray(p_B, np.float64)
  right = (p > 0.5) == (np.asarray(truth_B) > 0.5)
  conf = np.maximum(p, 1 - p)
  edges = np.linspace(0.5, 1.0, buckets + 1)
  idx = np.clip(np.searchsorted(edges, conf, side="right") - 1, 0, buckets - 1)
  return float(sum(abs(right[idx == k].mean() - conf[idx == k].mean()) * (idx == k).mean()
                   for k in range(buckets) if (idx == k).any()))


def _last_logits(graphdef, state, tokens_BT, last_B):
  model = nnx.merge(graphdef, state)
  segment_ids_BT = (jnp.arange(tokens_BT.shape[1])[None] <= last_B[:, None]).astype(jnp.int32)
  x_BTD = model.hidden(tokens_BT, None, segment_ids_BT)
  x_B1D = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)
  return jax.nn.log_softmax(model.unembed(x_B1D)[:, 0].astype(jnp.float32), axis=-1)


class PairwiseJudge:
  """A decoder teacher comparing two responses by its verdict-token probabilities."""

  def __init__(self, model, tokenizer, *, rubric: str = RUBRIC, max_len: int = 640,
               batch_size: int = 8, response_tokens: int = 160, min_mass: float = 0.05,
               temperature: float = 1.0, prefill: str = PREFILL):
    if not tokenizer.chat_template:
      raise ValueError("the pairwise judge needs a chat model (its tokenizer has no template)")
    ids = [tokenizer.encode(v, add_bos=False) for v in VERDICTS]
    if any(len(i) != 1 for i in ids) or ids[0] == ids[1]:
      raise ValueError(f"the teacher's tokenizer must encode {VERDICTS} as two single tokens; "
                       f"got {ids}")
    if temperature <= 0:
      raise ValueError(f"judge temperature must be > 0, got {temperature}")
    self.verdict_ids = [i[0] for i in ids]
    self.tokenizer, self.rubric, self.prefill = tokenizer, rubric, prefill
    self.max_len, self.batch_size = min(max_len, model.cfg.max_seq_len), batch_size
    self.response_tokens, self.min_mass, self.temperature = response_tokens, min_mass, temperature
    overhead = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": rubric},
         {"role": "user", "content": QUESTION.format(prompt="", a="", b="")}]) + prefill,
        add_bos=False))
    if self.max_len < overhead + 2 * response_tokens + 64:
      raise ValueError(f"judge max_len={self.max_len} leaves too little room: the rubric and "
                       f"template take {overhead} tokens and two responses up to "
                       f"{2 * response_tokens}; raise max_len or lower response_tokens")
    self.graphdef, self.state = nnx.split(model)
    self._fn = jax.jit(_last_logits, static_argnums=0)

  def _clip(self, text: str, limit: int, keep_end: bool = False) -> str:
    ids = self.tokenizer.encode(text, add_bos=False)
    if len(ids) <= limit:
      return text
    return self.tokenizer.decode(ids[-limit:] if keep_end else ids[:limit])

  def prompt_ids(self, prompt: str, first: str, second: str) -> list[int]:
    """The teacher's input for one order: rubric, conversation, the two responses, prefill."""
    first, second = (self._clip(r, self.response_tokens) for r in (first, second))
    overhead = len(self.tokenizer.encode(QUESTION.format(prompt="", a=first, b=second) +
                                         self.rubric + self.prefill, add_bos=False)) + 32
    prompt = self._clip(prompt, max(self.max_len - overhead, 16), keep_end=True)
    text = self.tokenizer.apply_chat_template(
        [{"role": "system", "content": self.rubric},
         {"role": "user", "content": QUESTION.format(prompt=prompt, a=first, b=second)}])
    ids = self.tokenizer.encode(text + self.prefill, add_bos=False)
    if len(ids) > self.max_len:
      raise ValueError(f"judge prompt of {len(ids)} tokens exceeds max_len={self.max_len}")
    return ids

  def first_better(self, sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(P(first shown is better), verdict-token mass) of each teacher input."""
    p_N, mass_N = [], []
    for start in range(0, len(sequences), self.batch_size):
      chunk = sequences[start:start + self.batch_size]
      # lengths rounded up to 128 and rows to a power of two: few shapes to compile, little
      # padding to compute (one prompt's two orders are 2 rows, not batch_size)
      t = min(-(-max(len(s) for s in chunk) // 128) * 128, self.max_len)
      rows = min(1 << (len(chunk) - 1).bit_length(), self.batch_size)
      tokens = np.zeros((rows, t), np.int32)
      last = np.zeros((rows,), np.int32)
      for i, s in enumerate(chunk):
        tokens[i, :len(s)], last[i] = s, len(s) - 1
      logp_BV = np.asarray(self._fn(self.graphdef, self.state, tokens, last))[:len(chunk)]
      a_B, b_B = logp_BV[:, self.verdict_ids[0]], logp_BV[:, self.verdict_ids[1]]
      p_N.append(1.0 / (1.0 + np.exp(b_B - a_B)))
      mass_N.append(np.exp(a_B) + np.exp(b_B))
    return np.concatenate(p_N), np.concatenate(mass_N)

  def judge(self, items: list[tuple[str, str, str]]) -> list[Judgement]:
    """Judgements of (prompt, response_a, response_b) triples, each shown in both orders."""
    sequences = []
    for prompt, a, b in items:
      sequences += [self.prompt_ids(prompt, a, b), self.prompt_ids(prompt, b, a)]
    if not sequences:
      return []
    p_N, mass_N = self.first_better(sequences)
    return [combine(float(p_N[2 * i]), float(p_N[2 * i + 1]),
                    float(min(mass_N[2 * i], mass_N[2 * i + 1])),
                    temperature=self.temperature, min_mass=self.min_mass)
            for i in range(len(items))]


class RewardJudge:
  """A `meshlm rm` workdir (full fine-tuning) as judge: p(A better) = sigmoid(r_A - r_B)."""

  def __init__(self, workdir: str, *, max_len: int = 512, batch_size: int = 8,
               temperature: float = 1.0):
    self.tokenizer = load_tokenizer(workdir)
    self.scorer = RewardModelScorer(workdir, self.tokenizer)
    self.max_len, self.batch_size, self.temperature = max_len, batch_size, temperature

  def _row(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids ending in EOS) as RM training encodes them (align/data.py);
    a long prompt keeps its end, a long response its start (and its EOS, where it is read)."""
    ids_N, mask_N = encode_chat(self.tokenizer, [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": response}])
    k = int(np.argmax(mask_N))
    p, c = ids_N[:k].tolist(), ids_N[k:].tolist()
    budget = self.max_len + 1  # a row of T + 1 ids gives T inputs and T targets
    if len(p) + len(c) > budget:
      p = p[-(budget // 2):]
      c = c[:budget - len(p) - 1] + c[-1:]
    return p, c

  def scores(self, prompt: str, responses: list[str]) -> np.ndarray:
    """One reward per response to a one-turn chat prompt."""
    rows = [self._row(prompt, r) for r in responses]
    out = []
    for s in range(0, len(rows), self.batch_size):
      chunk = rows[s:s + self.batch_size]
      batch = completion_batch([p for p, _ in chunk], [c for _, c in chunk], self.max_len)
      out.append(self.scorer(Rollout(batch, [], [], []))[:len(chunk)])
    return np.concatenate(out)

  def judge(self, items: list[tuple[str, str, str]]) -> list[Judgement]:
    results = []
    for prompt, a, b in items:
      r_a, r_b = self.scores(prompt, [a, b])
      p = float(1.0 / (1.0 + np.exp(r_b - r_a)))
      results.append(combine(p, 1.0 - p, 1.0, temperature=self.temperature))
    return results
