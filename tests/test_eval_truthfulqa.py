"""TruthfulQA MC1/MC2: log-likelihoods against transformers, the MC2 arithmetic, determinism,
and malformed rows (align/evals/loglik.py, align/evals/truthfulqa.py)."""

import json
import math
import os

import numpy as np
import pytest

import models
from align.evals import loglik, truthfulqa
import deps

# Per-token tolerance: tests/test_gguf.py bounds SmolLM2's logits against transformers by 1e-3
# (same dequantized weights, float32 summation order over 30 layers). A token's log-softmax
# moves by at most twice the largest logit change (its own logit and the log-sum-exp), so a
# continuation of n tokens may differ by at most 2e-3 * n nats.
LOGIT_TOL = 1e-3
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "truthfulqa", "mc_task.json")


def _tol(n_tokens):
  return 2 * LOGIT_TOL * np.asarray(n_tokens, np.float64)


@pytest.fixture(scope="module")
def smollm():
  path = deps.smollm()
  model, tok = models.load_pretrained(path)
  return path, model, tok


@pytest.fixture(scope="module")
def smollm_hf(smollm):
  for module in ("torch", "transformers", "accelerate"):  # accelerate: to load a gguf_file
    deps.require(module)
  from benchmarks import truthfulqa_parity
  return truthfulqa_parity, *truthfulqa_parity.load_hf(smollm[0])


@pytest.fixture(scope="module")
def records():
  with open(DATA, encoding="utf-8") as f:
    return json.load(f)


def _pairs(rec, key="mc1_targets"):
  ctx = truthfulqa.context(rec["question"].strip())
  return [(ctx, " " + c) for c in rec[key]]


def test_logliks_and_mc1_picks_match_transformers(smollm, smollm_hf, records):
  _, model, tok = smollm
  parity, hf_model, hf_tok = smollm_hf
  recs = records[:12]
  pairs = [p for r in recs for p in _pairs(r)]
  ours_N, n_N, _ = loglik.continuation_logliks(model, tok, pairs, return_details=True)
  theirs_N = parity.hf_logliks(hf_model, hf_tok, pairs)
  assert n_N.min() >= 1
  # the same harness split on both sides: the token counts agree with transformers' own
  assert list(n_N) == [len(parity.hf_split(hf_tok, c, x)[1]) for c, x in pairs]
  assert np.all(np.abs(ours_N - theirs_N) <= _tol(n_N)), np.abs(ours_N - theirs_N).max()
  at = 0
  for r in recs:
    k = len(r["mc1_targets"])
    assert np.argmax(ours_N[at:at + k]) == np.argmax(theirs_N[at:at + k]), r["question"]
    at += k


def test_shared_prefix_cache_equals_full_forward(smollm, smollm_hf, records):
  """meshlm runs the primer once into a KV cache; transformers here runs each whole input."""
  _, model, tok = smollm
  parity, hf_model, hf_tok = smollm_hf
  pairs = [_pairs(records[i])[1] for i in (20, 40)]
  pairs.append(("The capital of France is", " Paris."))  # no primer: nothing shared
  ours_N, n_N, _ = loglik.continuation_logliks(model, tok, pairs, return_details=True)
  full_N = parity.hf_logliks(hf_model, hf_tok, pairs, share_prefix=False)
  assert np.all(np.abs(ours_N - full_N) <= _tol(n_N)), np.abs(ours_N - full_N).max()


def test_encode_pair_follows_the_harness(smollm):
  tok = smollm[2]
  ctx, cont = loglik.encode_pair(tok, "Q: Is the sky blue?\nA:", " Yes.")
  assert ctx + cont == tok.encode("Q: Is the sky blue?\nA: Yes.")
  assert tok.decode(cont) == " Yes."
  # trailing whitespace of the context moves to the continuation
  assert loglik.encode_pair(tok, "Q: Is the sky blue?\nA: ", "Yes.") == (ctx, cont)
  # an empty context conditions on the BOS token
  assert loglik.encode_pair(tok, "", "Hello")[0] == [tok.bos_id]


def test_mc2_and_mc1_arithmetic_by_hand():
  ll_true, ll_false = np.log([0.2, 0.1]), np.log([0.3, 0.4])
  assert truthfulqa.mc2_score(ll_true, ll_false) == pytest.approx(0.3 / 1.0, abs=1e-12)
  # log-likelihoods far below exp's range still give the ratio, not 0/0
  assert truthfulqa.mc2_score([-1000.0], [-1001.0]) == pytest.approx(1 / (1 + math.exp(-1)))
  row = {"id": "t", "question": "q?", "mc1": (("right", "wrong", "other"), (1, 0, 0)),
         "mc2": (("a", "b", "c", "d"), (1, 0, 1, 0))}
  ll1 = np.log([0.2, 0.5, 0.3])
  ll2 = np.log([0.1, 0.2, 0.3, 0.4])
  out = truthfulqa.score_row(row, ll1, ll2)
  assert (out["chosen"], out["mc1_correct"]) == ("wrong", False)
  assert out["p_chosen"] == pytest.approx(0.5) and out["p_correct"] == pytest.approx(0.2)
  assert out["mc2"] == pytest.approx(0.4)  # labels: p(a) + p(c) = 0.1 + 0.3
  # the harness splits at the first 0 label, so it counts only "a" as true
  assert out["mc2_harness"] == pytest.approx(0.1)


def _write(tmp_path, records):
  """Five real questions (shortened to few choices: fewer requests to score) and four
  malformed rows (the loader refuses a file that is mostly malformed)."""
  bad = [
      {"mc1_targets": {"a": 1, "b": 0}, "mc2_targets": {"a": 1, "b": 0}},  # no question
      {"question": "Two right?", "mc1_targets": {"a": 1, "b": 1}, "mc2_targets": {"a": 1, "b": 0}},
      {"question": "None right?", "mc1_targets": {"a": 0, "b": 0}, "mc2_targets": {"a": 1, "b": 0}},
      {"question": "All true?", "mc1_targets": {"a": 1, "b": 0}, "mc2_targets": {"a": 1, "b": 1}},
  ]

  def short(targets, n_true, n_false):
    items = list(targets.items())
    return dict([i for i in items if i[1]][:n_true] + [i for i in items if not i[1]][:n_false])
  good = [dict(r, mc1_targets=short(r["mc1_targets"], 1, 2),
               mc2_targets=short(r["mc2_targets"], 2, 2)) for r in records[:5]]
  path = tmp_path / "mc_task.json"
  path.write_text(json.dumps(good[:3] + bad + good[3:]))
  return str(path), good


def test_evaluate_skips_malformed_rows_and_is_deterministic(smollm, records, tmp_path):
  _, model, tok = smollm
  path, good = _write(tmp_path, records)
  first = truthfulqa.evaluate(model, tok, path=path, seed=3)
  again = truthfulqa.evaluate(model, tok, path=path, seed=3)
  assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
  assert first["skipped"] == {"missing:question": 1, "mc1_not_one_correct_of_several": 1,
                              "no_correct_answer:mc1_targets": 1, "mc2_no_incorrect_choice": 1}
  m = first["metrics"]
  assert set(m) == {"honest/truthfulqa_mc1", "honest/truthfulqa_mc2", "honest/mc1_ece",
                    "honest/mc1_brier"}
  assert all(v["n"] == 5 and v["dimension"] == "honest" for v in m.values())
  assert m["honest/truthfulqa_mc1"]["higher_is_better"]
  assert not m["honest/mc1_ece"]["higher_is_better"]
  per_q = first["per_question"]
  assert [q["question"] for q in per_q] == [r["question"] for r in good]
  assert m["honest/truthfulqa_mc1"]["value"] == np.mean([q["mc1_correct"] for q in per_q])
  for q, r in zip(per_q, good):
    assert 0 < q["mc2"] < 1 and 1 / len(q["mc1_logliks"]) <= q["p_chosen"] <= 1
    assert q["mc1_correct"] == (r["mc1_targets"][q["chosen"]] == 1)
    assert q["mc1_correct"] == (np.argmax(q["mc1_logliks"]) == 0)  # the dataset lists it first
  lo, hi = m["honest/mc1_ece"]["ci"]
  assert 0 <= lo <= hi <= 1
  assert sum(b["n"] for b in first["calibration"]) == 5


def test_bad_arguments_raise(smollm):
  _, model, tok = smollm
  with pytest.raises(ValueError, match="encodes to no tokens"):
    loglik.continuation_logliks(model, tok, [("Q: hi\nA:", "")])
  with pytest.raises(ValueError, match="batch_size"):
    loglik.continuation_logliks(model, tok, [("Q: hi\nA:", " yes")], batch_size=0)
