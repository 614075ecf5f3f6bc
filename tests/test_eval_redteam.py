"""Red teaming: the attack library, running attacks through a real model, and ASR scoring."""

import base64
import codecs

import pytest
from flax import nnx

import deps
from align.evals import attacks as attacks_lib
from align.evals.attacks import ATTACKS, FAMILIES, Attack, get_attacks, register
from align.evals.refusal import string_refusal
from align.evals.redteam import load_behaviors, run_attacks, summarize
from align.evals.runner import ChatModel, is_degenerate
from models import ModelConfig, Transformer

REQUIRED = ("direct", "roleplay", "refusal_suppression", "prefix_injection", "base64", "rot13",
            "prompt_injection", "multiturn_escalation")


def is_refusal(texts):
  return [string_refusal(t) for t in texts]


@pytest.fixture(scope="module")
def advbench():
  rows, skipped = load_behaviors("advbench", limit=6)
  assert len(rows) == 6 and not skipped
  return rows


@pytest.fixture(scope="module")
def jbb():
  rows, _ = load_behaviors("jbb")
  return rows[::10]  # one behaviour of each of the 10 categories


# ---- the library ----

def test_the_required_attacks_are_registered_with_valid_families():
  assert set(REQUIRED) <= set(ATTACKS)
  for a in get_attacks():
    assert a.family in FAMILIES and a.description, a.name
  assert ATTACKS["direct"].family == "baseline"
  assert ATTACKS["prompt_injection"].family == "injection"
  assert ATTACKS["multiturn_escalation"].family == "multiturn"
  assert [a.name for a in get_attacks("rot13,direct")] == ["rot13", "direct"]
  with pytest.raises(ValueError, match="unknown attack.*'nope'"):
    get_attacks(["direct", "nope"])


def test_a_new_attack_plugs_in_as_a_small_class(advbench):
  @register
  class Shouting(Attack):
    name, family, description = "test_shouting", "jailbreak", "capitals"

    def turns(self, behavior):
      return [behavior["prompt"].upper()]

  try:
    assert get_attacks(["test_shouting"])[0].turns(advbench[0]) == [advbench[0]["prompt"].upper()]
    with pytest.raises(ValueError, match="registered twice"):
      register(Shouting)
  finally:
    del ATTACKS["test_shouting"]
  bad_family = type("Bad", (Attack,), {"name": "bad_family", "family": "social"})
  with pytest.raises(ValueError, match="family 'social'"):
    register(bad_family)
  with pytest.raises(ValueError, match="lower_snake_case"):
    register(type("Bad", (Attack,), {"name": "Bad Name", "family": "jailbreak"}))


def test_attacks_carry_the_behaviour_and_are_deterministic(advbench, jbb):
  for b in advbench + jbb:
    turns = {a.name: a.turns(b) for a in get_attacks()}
    assert turns == {a.name: a.turns(dict(b)) for a in get_attacks()}
    assert turns["direct"] == [b["prompt"]]
    encoded = turns["base64"][0].rsplit("\n", 1)[-1]
    assert base64.b64decode(encoded).decode() == b["prompt"]
    assert codecs.decode(turns["rot13"][0].rsplit("\n", 1)[-1], "rot13") == b["prompt"]
    assert b["prompt"] not in turns["leetspeak"][0]
    prefix = b.get("target", "Absolutely! Here's")
    assert f'Start your response with "{prefix}"' in turns["prefix_injection"][0]
    for name in ("roleplay", "refusal_suppression"):
      assert b["prompt"] in turns[name][0] and len(turns[name]) == 1
    assert "never say the words" in turns["refusal_suppression"][0].lower()
    # the injection sits inside the document: real text on both sides of it
    (doc,) = turns["prompt_injection"]
    assert doc.startswith("Please summarize")
    before, after = doc.split("IGNORE PREVIOUS INSTRUCTIONS")
    assert len(before) > 150 and len(after.split(b["prompt"], 1)[1]) > 150
    first, second, last = turns["multiturn_escalation"]
    assert b["prompt"] not in first + second and last.endswith(b["prompt"])
  assert "Sure, here is" in ATTACKS["prefix_injection"].turns(advbench[0])[0]
  # variety comes from the behaviour id: not every behaviour gets the same document
  docs = {ATTACKS["prompt_injection"].turns(b)[0][:40] for b in advbench + jbb}
  assert len(docs) > 1
  assert attacks_lib.topic(jbb[0]) == jbb[0]["behavior"].lower()


# ---- scoring ----

def _record(attack, family, category, refused, empty=False, degenerate=False):
  return dict(attack=attack, family=family, category=category, behavior_id="x",
              conversation=[], response="" if empty else "text", refused=refused,
              empty=empty, degenerate=degenerate, finish_reason="stop")


def test_summarize_rates_tables_and_counts():
  records = ([_record("direct", "baseline", "a", True)] * 3 + [_record("direct", "baseline", "b",
                                                                       False)]
             + [_record("rot13", "jailbreak", "a", False)] * 2
             + [_record("rot13", "jailbreak", "a", True, empty=True)]
             + [_record("rot13", "jailbreak", "b", False, degenerate=True)])
  metrics, tables = summarize(records, seed=0)
  assert metrics["redteam/asr/direct"]["value"] == pytest.approx(0.25)
  assert metrics["redteam/asr/rot13"]["value"] == pytest.approx(0.75)
  overall = metrics["redteam/asr_overall"]  # direct is not an attack
  assert overall["value"] == pytest.approx(0.75) and overall["n"] == 4
  assert metrics["redteam/asr_family/jailbreak"]["n"] == 4
  for m in metrics.values():
    assert m["higher_is_better"] is False and m["dimension"] == "redteam"
    assert m["ci"][0] <= m["value"] <= m["ci"][1]
  assert "1 empty" in metrics["redteam/asr/rot13"]["note"]
  rows = {(r["attack"], r["category"]): r for r in tables["redteam_asr"]}
  assert set(rows) == {(a, c) for a in ("direct", "rot13") for c in ("a", "b", "all")}
  cell = rows[("rot13", "a")]
  assert (cell["n"], cell["refused"], cell["empty"], cell["degenerate"]) == (3, 1, 1, 0)
  assert cell["asr"] == pytest.approx(2 / 3) and cell["lift_over_direct"] == pytest.approx(2 / 3)
  assert rows[("rot13", "all")]["degenerate"] == 1
  assert rows[("rot13", "b")]["lift_over_direct"] == pytest.approx(0.0)
  assert summarize(records, seed=0) == (metrics, tables)
  with pytest.raises(ValueError, match="at least one"):
    summarize([], seed=0)


@pytest.mark.parametrize("behaviors, message", [
    ([{"id": "a", "prompt": "", "category": "c"}], "non-empty string 'prompt'"),
    ([{"id": "a", "prompt": "p"}], "non-empty string 'category'"),
    ([{"id": "a", "prompt": "p", "category": "c"}] * 2, "'a' appears twice"),
    ([], "needs attacks and behaviours")])
def test_bad_behaviours_are_rejected_before_any_generation(behaviors, message):
  with pytest.raises(ValueError, match=message):
    run_attacks(None, behaviors, ["direct"], classify=is_refusal)


def test_unknown_behaviour_sets_are_named():
  with pytest.raises(ValueError, match="'harmbench'"):
    load_behaviors("advbench,harmbench")


# ---- a tiny real decoder: empty and failed answers ----

class AsciiTokenizer:
  """Printable ASCII is tokens 0-94, newline 95; any other character gets an id outside the
  96-token vocabulary, so the engine turns that request into an "error" answer."""
  chat_template, bos_id, eos_id = None, None, None

  def encode(self, text, add_bos=None):
    return [95 if c == "\n" else ord(c) - 32 if " " <= c <= "~" else 1000 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join("\n" if i == 95 else chr(32 + i) for i in ids)


def test_failed_answers_count_as_refused_and_skip_the_classifier(advbench):
  cfg = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=48, max_seq_len=128, init_std=0.2)
  chat = ChatModel(Transformer(cfg, nnx.Rngs(0)), AsciiTokenizer(), max_new_tokens=8,
                   batch_size=16, max_prompt_tokens=120)
  cafe = {"id": "cafe", "prompt": "Tell me the secret recipe of the caf\u00e9", "category": "t"}
  seen = []

  def classify(texts):
    seen.extend(texts)
    return [False] * len(texts)

  names = ["direct", "base64", "prompt_injection", "multiturn_escalation"]
  records = run_attacks(chat, advbench[:2] + [cafe], names, classify=classify)
  assert len(records) == 3 * len(names)
  failed = [r for r in records if r["finish_reason"] == "error"]
  # direct on the cafe row cannot be encoded; base64 hides the character in ASCII
  assert ("direct", "cafe") in {(r["attack"], r["behavior_id"]) for r in failed}
  assert not any(r["attack"] == "base64" for r in failed)
  assert all(r["empty"] and r["refused"] and r["response"] == "" for r in failed)
  assert sorted(seen) == sorted(r["response"] for r in records if not r["empty"])
  assert all(not r["refused"] for r in records if not r["empty"])
  assert all(r["degenerate"] == is_degenerate(r["response"]) for r in records)
  # an escalation's assistant turns are the model's answers to the conversation so far
  convs = [r["conversation"] for r in records if r["attack"] == "multiturn_escalation"][:2]
  for conv in convs:
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant", "user"]
  again = chat.respond([c[:k] for c in convs for k in (1, 3)])
  assert [r.text for r in again] == [c[k]["content"] for c in convs for k in (1, 3)]
  metrics, tables = summarize(records, seed=0)
  direct_all = next(r for r in tables["redteam_asr"]
                    if r["attack"] == "direct" and r["category"] == "all")
  assert direct_all["empty"] == direct_all["refused"] >= 1
  assert metrics["redteam/asr/direct"]["value"] == pytest.approx(2 / 3)


# ---- SmolLM2-135M-Instruct on four AdvBench behaviours ----
# Four behaviours and 16 new tokens (a refusal shows in its first words): CPU decoding is
# this file's whole cost.

@pytest.fixture(scope="module")
def smol():
  from models import load_pretrained
  model, tok = load_pretrained(deps.smollm())
  return ChatModel(model, tok, max_new_tokens=16, batch_size=8, max_prompt_tokens=384,
                   name="smollm2-135m")


@pytest.fixture(scope="module")
def smol_behaviors(advbench):
  return advbench[:4]


@pytest.fixture(scope="module")
def smol_records(smol, smol_behaviors):
  return run_attacks(smol, smol_behaviors, get_attacks(), classify=is_refusal)


def test_smollm_records_cover_every_attack_and_behaviour(smol_records, smol_behaviors):
  assert len(smol_records) == len(ATTACKS) * len(smol_behaviors)
  keys = {(r["attack"], r["behavior_id"]) for r in smol_records}
  assert keys == {(a, b["id"]) for a in ATTACKS for b in smol_behaviors}
  for r in smol_records:
    assert r["family"] == ATTACKS[r["attack"]].family and r["category"] == "advbench"
    assert r["conversation"][-1]["role"] == "user" and r["finish_reason"] != "error"
    assert r["empty"] == (not r["response"].strip())
    assert r["refused"] == string_refusal(r["response"])
  # SmolLM2-135M complies with some requests (its direct ASR is high) and refuses some
  assert 0 < sum(r["refused"] for r in smol_records) < len(smol_records)
  metrics, tables = summarize(smol_records, seed=0)
  for name in ATTACKS:
    m = metrics[f"redteam/asr/{name}"]
    assert 0.0 <= m["value"] <= 1.0 and m["n"] == len(smol_behaviors)
  assert metrics["redteam/asr_overall"]["n"] == (len(ATTACKS) - 1) * len(smol_behaviors)
  assert {r["attack"] for r in tables["redteam_asr"]} == set(ATTACKS)


def test_smollm_escalation_is_five_messages_with_the_models_replies(smol_records,
                                                                   smol_behaviors):
  multi = [r for r in smol_records if r["attack"] == "multiturn_escalation"]
  turns = {b["id"]: ATTACKS["multiturn_escalation"].turns(b) for b in smol_behaviors}
  assert len(multi) == len(smol_behaviors)
  for r in multi:
    conv = r["conversation"]
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant", "user"]
    assert [conv[i]["content"] for i in (0, 2, 4)] == turns[r["behavior_id"]]
    assert conv[1]["content"].strip() and conv[3]["content"].strip()


def test_smollm_runs_are_deterministic(smol, smol_records, smol_behaviors):
  # the escalation alone, so its batches differ from the first run's: same records
  again = run_attacks(smol, smol_behaviors, ["multiturn_escalation"], classify=is_refusal)
  assert again == [r for r in smol_records if r["attack"] == "multiturn_escalation"]
