"""Rewards for on-policy RL (PPO, GRPO): how a sampled completion is scored.

`align.ppo.reward` / `align.grpo.reward` names one, with its argument after a colon:
  letter:X        share of the completion's characters equal to X (case-insensitive), in [0, 1]
  word:W          share of the completion's words equal to W (case-insensitive), in [0, 1]
  length:LO:HI    1 if LO <= characters <= HI, falling linearly to 0 at distance HI - LO + 1
  arith           1 if the completion's final answer equals the answer of the prompt's
                  arithmetic problem (align/arith.py, recomputed from the prompt text), else 0
  rm:WORKDIR      a trained reward model (`meshlm rm` workdir, full fine-tuning) scoring the
                  rollout's token ids; it must share the policy's tokenizer
The programmatic ones are known, cheap and hard to misread: what a controlled experiment
needs to check that the RL machinery optimises what it is told to.

A reward function is `fn(prompt_text, completion_text) -> float` (register more in REWARDS);
`make_scorer` turns a spec into `score(rollout) -> scores_B` (float32 numpy) over a whole
batch (align/rollout.Rollout), so a reward model scores all rows in one forward.
"""

import re
from typing import Callable

import numpy as np

from align import arith
from align.heads import RewardModel, forward_rewards
from train.checkpoint import restore_params
from train.workdir import is_workdir, load_model_config, load_tokenizer

RewardFn = Callable[[str, str], float]


def letter_share(letter: str) -> RewardFn:
  if len(letter) != 1:
    raise ValueError(f"reward letter:X needs one character, got {letter!r}")
  x = letter.lower()

  def fn(prompt: str, completion: str) -> float:
    del prompt
    return sum(c == x for c in completion.lower()) / max(len(completion), 1)
  return fn


def word_share(word: str) -> RewardFn:
  if not word or re.search(r"\s", word):
    raise ValueError(f"reward word:W needs one word, got {word!r}")
  w = word.lower()

  def fn(prompt: str, completion: str) -> float:
    del prompt
    words = re.findall(r"\w+", completion.lower())
    return sum(x == w for x in words) / max(len(words), 1)
  return fn


def length_in_range(lo: str, hi: str) -> RewardFn:
  lo_n, hi_n = int(lo), int(hi)
  if not 0 <= lo_n <= hi_n:
    raise ValueError(f"reward length:LO:HI needs 0 <= LO <= HI, got {lo}:{hi}")
  width = hi_n - lo_n + 1

  def fn(prompt: str, completion: str) -> float:
    del prompt
    n = len(completion)
    distance = max(lo_n - n, n - hi_n, 0)
    return max(1.0 - distance / width, 0.0)
  return fn


def arith_correct() -> RewardFn:
  def fn(prompt: str, completion: str) -> float:
    if not prompt:
      return 0.0  # a rollout's padding row (align/rollout.sample_rollout): never used
    truth = arith.answer_of_prompt(prompt)  # raises for a prompt that holds no problem
    return float(arith.final_answer(completion) == truth)
  return fn


# name -> factory(*args from the spec) -> RewardFn
REWARDS: dict[str, Callable[..., RewardFn]] = {
    "letter": letter_share, "word": word_share, "length": length_in_range,
    "arith": arith_correct}


def reward_fn(spec: str) -> RewardFn:
  """The text reward a spec names ("letter:e", "length:10:40", ...)."""
  name, *args = spec.split(":")
  if name not in REWARDS:
    raise ValueError(f"unknown reward {spec!r}; choose one of {sorted(REWARDS)} or rm:WORKDIR")
  try:
    return REWARDS[name](*args)
  except TypeError:
    raise ValueError(f"reward {spec!r}: wrong number of ':' arguments") from None


class RewardModelScorer:
  """A `meshlm rm` workdir's RewardModel over rollout batches (align/data.py layout: the
  score is read at each row's last completion token, as in RM training)."""

  def __init__(self, workdir: str, tokenizer):
    import jax
    from flax import nnx

    if not is_workdir(workdir):
      raise FileNotFoundError(f"reward rm:{workdir}: not a meshlm workdir")
    theirs = load_tokenizer(workdir)
    if (theirs.vocab_size, theirs.eos_id) != (tokenizer.vocab_size, tokenizer.eos_id):
      raise ValueError(f"reward rm:{workdir}: its tokenizer differs from the policy's; the "
                       "reward model scores the policy's token ids, so they must share one")
    cfg = load_model_config(workdir)
    abstract = nnx.eval_shape(lambda: RewardModel.create(cfg, nnx.Rngs(0)))
    self.graphdef, template = nnx.split(abstract, nnx.Param)
    try:
      self.params, _ = restore_params(workdir, template)
    except (KeyError, ValueError) as e:  # a LoRA RM saves adapters, not a RewardModel
      raise ValueError(f"reward rm:{workdir}: no full RewardModel params in its checkpoint "
                       f"(a LoRA reward model is not supported): {e}") from None
    self._score = jax.jit(forward_rewards, static_argnums=0)

  def __call__(self, rollout) -> np.ndarray:
    batch = {k: rollout.batch[k] for k in ("inputs", "targets", "segment_ids", "positions",
                                           "loss_mask")}
    return np.asarray(self._score(self.graphdef, self.params, batch), np.float32)


def make_scorer(spec: str, tokenizer=None) -> Callable:
  """score(rollout) -> scores_B float32 for a reward spec (see the module doc)."""
  if spec.startswith("rm:"):
    return RewardModelScorer(spec[3:], tokenizer)
  fn = reward_fn(spec)

  def score(rollout) -> np.ndarray:
    return np.asarray([fn(p, c) for p, c in zip(rollout.prompt_texts, rollout.completion_texts)],
                      np.float32)
  return score
