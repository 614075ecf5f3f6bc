"""The teacher judge (align/curate/judge.py): position debiasing, calibration, unparsable verdicts.

The model tests use the real SmolLM2-135M-Instruct as teacher.
"""

import math

import numpy as np
import pytest

import deps
from align.curate.judge import (Judgement, PairwiseJudge, combine, expected_calibration_error,
                                fit_temperature)
from test_align_rl import rm_workdir  # noqa: F401  (a fixture: a tiny `meshlm rm` workdir)

PROMPT = "How do I keep basil fresh after buying it?"
GOOD = ("Trim the stems and stand the basil in a glass of water at room temperature, loosely "
        "covered with a bag; change the water every day or two. Don't refrigerate it: the "
        "leaves blacken below about 10 C.")
BAD = "Basil is a plant. Plants are green. I like turtles."


def test_combine_is_mirror_symmetric():
  for p_ab, p_ba in [(0.3, 0.4), (0.9, 0.2), (0.55, 0.55), (0.1, 0.95)]:
    x, y = combine(p_ab, p_ba, 0.9, temperature=0.3), combine(p_ba, p_ab, 0.9, temperature=0.3)
    assert x.p_a == pytest.approx(1.0 - y.p_a, abs=1e-12)
    assert x.confidence == pytest.approx(y.confidence, abs=1e-12)
    assert {x.verdict, y.verdict} in ({"A", "B"}, {"tie"})
    assert x.agree == y.agree


def test_combine_values():
  j = combine(0.3, 0.4, 1.0)  # P(A first)=0.3, P(B first)=0.4 -> P(A better)=(0.3+0.6)/2
  assert j.p_a == pytest.approx(0.45) and j.verdict == "B" and not j.agree
  assert j.confidence == pytest.approx(0.1)
  j = combine(0.8, 0.3, 1.0)
  assert j.agree and j.verdict == "A" and j.p_a == pytest.approx(0.75)
  # temperature 0.5 doubles the logit
  sharp = combine(0.8, 0.3, 1.0, temperature=0.5)
  assert sharp.p_a == pytest.approx(1 / (1 + math.exp(-2 * math.log(3))))
  bad = combine(0.8, 0.3, 0.01, min_mass=0.05)
  assert bad.verdict == "unparsable" and bad.confidence == 0.0


def test_fit_temperature_recovers_a_known_temperature():
  rng = np.random.default_rng(0)
  z = rng.normal(0, 0.5, 4000)  # a judge whose logits are 4x too small
  truth = (rng.random(4000) < 1 / (1 + np.exp(-z / 0.25))).astype(float)
  p = 1 / (1 + np.exp(-z))
  t = fit_temperature(p, truth)
  assert 0.2 < t < 0.3
  cal = 1 / (1 + np.exp(-z / t))
  assert expected_calibration_error(cal, truth) < expected_calibration_error(p, truth)
  with pytest.raises(ValueError, match="0/1"):
    fit_temperature(p[:3], np.array([0.5, 1, 0]))


@pytest.fixture(scope="module")
def teacher():
  path = deps.smollm()
  from models import load_pretrained
  return load_pretrained(path)


def test_swapping_candidates_mirrors_the_debiased_verdict(teacher):
  """Must show: swapping the candidates' order does not change a position-debiased verdict."""
  model, tok = teacher
  judge = PairwiseJudge(model, tok, batch_size=4, temperature=0.2)
  items = [(PROMPT, GOOD, BAD), ("What is 2 + 2?", "4", "2 + 2 is 5.")]
  forward = judge.judge(items)
  swapped = judge.judge([(q, b, a) for q, a, b in items])
  for f, s in zip(forward, swapped):
    assert isinstance(f, Judgement) and f.verdict in ("A", "B")
    assert {f.verdict, s.verdict} == {"A", "B"}  # the same response wins
    assert f.p_a == pytest.approx(1.0 - s.p_a, abs=1e-4)
    assert f.confidence == pytest.approx(s.confidence, abs=2e-4)
    # each order alone is biased; the swap exchanges them
    assert f.p_ab == pytest.approx(s.p_ba, abs=1e-4) and f.p_ba == pytest.approx(s.p_ab, abs=1e-4)
    assert f.mass > 0.5  # the prefill makes the teacher answer " A" or " B"


def test_a_teacher_that_does_not_answer_is_unparsable(teacher):
  model, tok = teacher
  derail = "The capital of France is Paris. The population of Paris is about"
  judge = PairwiseJudge(model, tok, batch_size=2, prefill=derail, min_mass=0.05)
  [j] = judge.judge([(PROMPT, GOOD, BAD)])
  assert j.verdict == "unparsable" and j.confidence == 0.0 and j.mass < 0.05


def test_judge_refuses_bad_settings(teacher):
  model, tok = teacher
  with pytest.raises(ValueError, match="temperature"):
    PairwiseJudge(model, tok, temperature=0.0)
  with pytest.raises(ValueError, match="max_len=256 leaves too little room"):
    PairwiseJudge(model, tok, max_len=256, response_tokens=128)


def test_a_reward_model_workdir_judges(rm_workdir):
  """teacher.mode=reward: a `meshlm rm` workdir (a tiny one, two steps) scores both
  responses; its verdict mirrors under a swap and matches its own reward margin."""
  from align.curate.judge import RewardJudge
  judge = RewardJudge(rm_workdir, max_len=64, batch_size=2)
  r_good, r_bad = judge.scores(PROMPT, [GOOD, BAD])
  [j] = judge.judge([(PROMPT, GOOD, BAD)])
  [k] = judge.judge([(PROMPT, BAD, GOOD)])
  assert j.p_a == pytest.approx(1 / (1 + math.exp(r_bad - r_good)), abs=1e-5)
  assert j.p_a == pytest.approx(1 - k.p_a, abs=1e-6)
  assert {j.verdict, k.verdict} == ({"tie"} if r_good == r_bad else {"A", "B"})
  # a long response is cut but keeps its EOS, where the reward is read
  p, c = judge._row(PROMPT, GOOD * 20)
  assert len(p) + len(c) == 65 and c[-1] == judge.tokenizer.eos_id


def test_a_meshlm_checkpoint_judges_like_the_model_it_holds(teacher, tmp_path):
  """Any meshlm workdir can be the teacher (a run's own earlier checkpoint): SmolLM2 saved
  as a workdir and loaded the way `meshlm pairs` loads teachers gives the same verdicts."""
  from flax import nnx

  from align.curate.pairs_publish import model_ref
  from infer.loading import load_any
  from train.workdir import save_model
  model, tok = teacher
  workdir = str(tmp_path / "run")
  save_model(workdir, model.cfg, tok, nnx.state(model, nnx.Param), step=7)
  loaded, loaded_tok = load_any(workdir)
  items = [(PROMPT, GOOD, BAD)]
  [a] = PairwiseJudge(model, tok, batch_size=2, temperature=0.2).judge(items)
  [b] = PairwiseJudge(loaded, loaded_tok, batch_size=2, temperature=0.2).judge(items)
  assert a.verdict == b.verdict and a.p_a == pytest.approx(b.p_a, abs=1e-5)
  ref = model_ref(workdir)
  assert ref["checkpoint_step"] == 7 and len(ref["tree_sha256"]) == 64
