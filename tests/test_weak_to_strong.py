"""Weak-to-strong (benchmarks/w2s_heads.py, benchmarks/w2s_features.py, benchmarks/weak_to_strong.py).

The auxiliary confidence loss and PGR against hand computations; the heads on fixed random
features; the bag-of-words featurizer by hand; the decoder feature extractor against the
model's own `hidden` on real text; and a tiny end-to-end run of the benchmark (bag of words,
real MiniLM and SmolLM2 features of 40 hh-rlhf pairs).
"""

import json
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deps
from benchmarks import w2s_heads as w2s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test.jsonl.gz")


# --- Losses and PGR: hand computations ---


def test_aux_conf_targets_by_hand():
  logits = jnp.array([2.0, -1.0, 0.5, -3.0])
  weak = jnp.array([0.9, 0.2, 0.6, 0.1])  # prior = mean = 0.45
  # p0 = 1 - sigmoid(logits) = [0.11920, 0.73106, 0.37754, 0.95257]; sorted
  # [0.11920, 0.37754, 0.73106, 0.95257]; quantile 0.45 (linear): position 0.45 * 3 = 1.35
  # -> 0.37754 + 0.35 * (0.73106 - 0.37754) = 0.50127; hardened = p0 < 0.50127 = [1, 0, 1, 0].
  p0 = 1 - 1 / (1 + np.exp(-np.array([2.0, -1.0, 0.5, -3.0])))
  assert np.allclose(np.sort(p0), [0.11920, 0.37754, 0.73106, 0.95257], atol=1e-5)
  got = w2s.aux_conf_targets(logits, weak, 0.5)
  # 0.5 * weak + 0.5 * [1, 0, 1, 0]
  assert np.allclose(got, [0.95, 0.10, 0.80, 0.05], atol=1e-6)
  assert np.allclose(w2s.aux_conf_targets(logits, weak, 0.0), weak, atol=1e-7)
  assert np.allclose(w2s.aux_conf_targets(logits, weak, 1.0), [1, 0, 1, 0], atol=1e-7)


def test_aux_hardening_matches_the_weak_prior():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=200), jnp.float32)
  for prior in (0.2, 0.5, 0.7):
    weak = jnp.full((200,), prior)
    hard = w2s.aux_conf_targets(logits, weak, 1.0)
    assert abs(float(hard.mean()) - prior) <= 1 / 200 + 1e-6
    # The hardened positives are the student's most confident ones.
    assert float(logits[hard > 0.5].min()) > float(logits[hard < 0.5].max())


def test_aux_loss_has_no_gradient_through_the_target():
  logits = jnp.array([2.0, -1.0, 0.5, -3.0])
  weak = jnp.array([0.9, 0.2, 0.6, 0.1])
  target = w2s.aux_conf_targets(logits, weak, 0.5)
  g_aux = jax.grad(lambda z: w2s.aux_conf_loss(z, weak, 0.5))(logits)
  g_fixed = jax.grad(lambda z: w2s.soft_xent(z, target))(logits)
  assert np.allclose(g_aux, g_fixed, atol=1e-7)
  # d/dz mean BCE = (sigmoid(z) - target) / N
  assert np.allclose(g_fixed, (jax.nn.sigmoid(logits) - target) / 4, atol=1e-7)


def test_soft_xent_by_hand():
  # -(0.7 log s(1) + 0.3 log(1 - s(1))) with s(1) = 0.731059
  want = -(0.7 * math.log(0.731059) + 0.3 * math.log(1 - 0.731059))
  assert abs(float(w2s.soft_xent(jnp.array([1.0]), jnp.array([0.7]))) - want) < 1e-5


def test_alpha_ramp():
  # alpha 0.75 reached after 20% of 100 steps, linearly from 0.
  got = [float(w2s.alpha_at(s, 100, 0.75, 0.2)) for s in (0, 5, 10, 20, 21, 99)]
  assert np.allclose(got, [0.0, 0.1875, 0.375, 0.75, 0.75, 0.75])
  assert float(w2s.alpha_at(0, 100, 0.5, 0.0)) == 0.5


def test_pgr_arithmetic():
  assert w2s.pgr(0.60, 0.65, 0.70) == pytest.approx(0.5)
  assert w2s.pgr(0.60, 0.58, 0.70) == pytest.approx(-0.2)
  assert w2s.pgr(0.60, 0.75, 0.70) == pytest.approx(1.5)
  assert math.isnan(w2s.pgr(0.60, 0.65, 0.60))  # no gap: undefined, not a division error


# --- Heads on fixed random features ---


def _synthetic(n, d, seed):
  """Chosen/rejected features whose preference is linear in them, plus noise."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=d)
  x = rng.normal(size=(2 * n, d)).astype(np.float32)
  s = x @ w
  first = s[:n] > s[n:]
  chosen = np.where(first[:, None], x[:n], x[n:])
  rejected = np.where(first[:, None], x[n:], x[:n])
  return chosen, rejected


def test_heads_learn_and_are_antisymmetric():
  chosen, rejected = _synthetic(400, 16, 0)
  a, b, label = w2s.present(chosen, rejected, seed=3)
  assert 0.4 < label.mean() < 0.6 and np.all(np.where(label[:, None] > 0, a, b) == chosen)
  # aux on true labels: 3/4 of its target is its own hardened guess, so it learns less.
  for hidden, loss, floor in ((0, "ground_truth", 0.85), (16, "ground_truth", 0.85),
                              (0, "aux", 0.75)):
    fit = w2s.train_head(a[:300], b[:300], label[:300], loss=loss, seed=0, hidden=hidden,
                         epochs=10, lr=1e-2)
    p = fit(a[300:], b[300:])
    assert w2s.accuracy(p, label[300:]) > floor, (hidden, loss)
    assert np.allclose(fit(b[300:], a[300:]), 1 - p, atol=1e-5)
  with pytest.raises(ValueError, match="loss="):
    w2s.train_head(a, b, label, loss="hinge", seed=0)


def test_constant_features_keep_unit_scale():
  # A bag-of-words bucket no training reply hits: scale 1, not 1e-6 (a test hit would be 1e6).
  a = np.array([[1.0, 0.0], [3.0, 0.0]])
  mean, scale = w2s.standardizer(a, a)
  assert np.allclose(mean, [2.0, 0.0]) and np.allclose(scale, [1.0 + 1e-6, 1.0])


# --- Bag of words ---


def test_bow_terms_and_hashing():
  from benchmarks.w2s_features import bow_bucket, bow_terms
  assert bow_terms("Don't STOP, don't!\n 42x") == [
      "don't", "stop", "don't", "42x", "don't stop", "stop don't", "don't 42x"]
  assert bow_terms("...") == []
  # CRC-32, not Python's per-process salted hash: these constants hold on any run.
  assert zlib.crc32(b"hello") == 907060870 and bow_bucket("hello", 4096) == 1670
  assert bow_bucket("hello world", 4096) == 389 and bow_bucket("don't", 16) == 15


def test_bow_features_by_hand():
  from benchmarks.w2s_features import bow_bucket, bow_features
  responses = ["Hello world hello", "", "hello world hello"]
  got = bow_features(["p1", "p2", "another prompt"], responses, buckets=4096)
  assert set(got) == {"bow"}
  x = got["bow"]
  assert x.shape == (3, 4096) and x.dtype == np.float32
  want = np.zeros(4096, np.float32)
  for term, count in (("hello", 2), ("world", 1), ("hello world", 1), ("world hello", 1)):
    want[bow_bucket(term, 4096)] += count
  assert np.allclose(x[0], np.log1p(want), atol=1e-6)
  assert not x[1].any()  # an empty reply: no terms
  assert np.array_equal(x[0], x[2])  # case-folded; the prompt is not a feature
  # Deterministic; with few buckets the collisions add up: every term is counted once.
  small = bow_features(["p"] * 3, responses, buckets=2)["bow"]
  assert np.array_equal(small, bow_features(["q"] * 3, responses, buckets=2)["bow"])
  assert np.allclose(np.expm1(small).sum(1), [5, 0, 5], atol=1e-5)
  with pytest.raises(ValueError, match="buckets"):
    bow_features(["p"], ["r"], buckets=1)
  with pytest.raises(ValueError, match="need equal"):
    bow_features(["p"], ["r", "s"])


def test_splits_keep_conversations_together():
  pairs, skipped = w2s.load_pairs(HH, limit=300)
  assert len(pairs) == 300 and all(isinstance(v, int) for v in skipped.values())
  splits = w2s.split_indices([p["key"] for p in pairs], 0.2)
  keys = {k: {pairs[i]["key"] for i in v} for k, v in splits.items()}
  assert not (keys["a"] & keys["b"]) and not (keys["a"] | keys["b"]) & keys["test"]
  assert sum(len(v) for v in splits.values()) == 300
  assert 0.1 < len(splits["test"]) / 300 < 0.3


def test_bad_input_is_named(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('not json\n{"chosen": "no turns"}\n{"chosen": "\\n\\nHuman: hi", '
                 '"rejected": "x"}\n')
  with pytest.raises(ValueError, match="no usable preference pairs"):
    w2s.load_pairs(str(bad))
  with pytest.raises(ValueError, match="test_fraction"):
    w2s.split_indices(["a", "b"], 1.5)


# --- Real models ---


@pytest.fixture(scope="module")
def smollm():
  from models import load_pretrained
  return load_pretrained(deps.smollm())


def test_decoder_features_match_hidden(smollm):
  """final_* read from the split stack equal the model's own hidden states, padding and all."""
  from benchmarks.w2s_features import decoder_features, decoder_ids
  model, tok = smollm
  pairs, _ = w2s.load_pairs(HH, limit=3)
  prompts = [p["prompt"] for p in pairs]
  responses = [p["chosen"] for p in pairs]
  feats = decoder_features(model, tok, prompts, responses, max_prompt=8, max_len=24,
                           batch_size=4)
  assert set(feats) == {"mid_mean", "mid_last", "final_mean", "final_last"}
  for i in range(3):
    ids, n_prompt = decoder_ids(tok, prompts[i], responses[i], 8, 24)
    h_TD = np.asarray(model.hidden(jnp.asarray([ids], jnp.int32))[0], np.float32)
    assert np.allclose(feats["final_last"][i], h_TD[-1], atol=2e-3, rtol=2e-3)
    assert np.allclose(feats["final_mean"][i], h_TD[n_prompt:].mean(0), atol=2e-3, rtol=2e-3)
  assert not np.allclose(feats["mid_mean"], feats["final_mean"], atol=1e-2)


def test_end_to_end_quick(tmp_path, smollm):
  """The benchmark on 40 real pairs: JSON structure, accuracies in [0, 1], PGR = its formula.
  Real MiniLM and SmolLM2 features (SmolLM2 handed over loaded: it is the slow part)."""
  from benchmarks import weak_to_strong as bench
  from experiments.weak_to_strong import get_config
  cfg = get_config("quick")
  cfg.limit, cfg.cache_dir, cfg.plot = 40, str(tmp_path), str(tmp_path / "pgr.png")
  cfg.features.max_len, cfg.features.max_prompt = 32, 12  # one padded length: one compile
  out = json.loads(json.dumps(bench.finite(bench.run(cfg, loaded={"decoder": smollm})),
                              allow_nan=False))
  assert not out["features"]["decoder"]["cached"] and out["data"]["pairs"] == 40
  assert sum(out["data"]["splits"].values()) == 40
  assert out["features"]["encoder"]["dim"] == 384 and out["features"]["decoder"]["dim"] == 576
  assert out["features"]["bow"]["buckets"] == 4096
  assert [(s["weak"], s["weak_train_pairs"]) for s in out["settings"]] == [("bow", 0),
                                                                          ("embed", 8)]
  for setting in out["settings"]:
    assert len(setting["per_seed"]) == 2
    for r in setting["per_seed"]:
      assert set(r["acc"]) == {"weak", "naive", "aux", "ceiling"}
      assert all(0.0 <= v <= 1.0 for v in r["acc"].values())
      for m in ("naive", "aux"):
        want = w2s.pgr(r["acc"]["weak"], r["acc"][m], r["acc"]["ceiling"])
        assert (r["pgr"][m] is None) if math.isnan(want) else r["pgr"][m] == pytest.approx(want)
    s = setting["summary"]
    for m in ("weak", "naive", "aux", "ceiling"):
      assert s["acc"][m]["mean"] == pytest.approx(np.mean([r["acc"][m]
                                                           for r in setting["per_seed"]]))
      lo, hi = s["acc"][m]["ci95_test"]
      assert 0.0 <= lo <= s["acc"][m]["mean"] <= hi <= 1.0
    for m in ("naive", "aux"):
      want = w2s.pgr(s["acc"]["weak"]["mean"], s["acc"][m]["mean"], s["acc"]["ceiling"]["mean"])
      got = s["pgr"][m]["of_mean_acc"]
      assert (got is None) if math.isnan(want) else got == pytest.approx(want)
    assert s["gap"]["mean"] == pytest.approx(s["acc"]["ceiling"]["mean"] -
                                             s["acc"]["weak"]["mean"])
  assert out["table_md"].count("\n") == 9 and os.path.getsize(out["plot"]) > 1000
  assert "bag of words (4k params), all of half A | weak |" in out["table_md"]
  assert "MiniLM-L6 (22M), 8 pairs of half A | strong ceiling |" in out["table_md"]
  with pytest.raises(ValueError, match="weak supervisor 'tfidf'"):
    bench.parse_supervisor("tfidf")
  assert bench.parse_supervisor("embed:64") == ("embed", 64)
  with pytest.raises(ValueError, match="positive pair count"):
    bench.parse_supervisor("bow:0")
