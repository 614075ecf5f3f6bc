"""Smoke tests for benchmarks/decode_speculative.py (row 4) and benchmarks/lookup_policy.py:
quick runs on SmolLM2 emit the JSON they promise; the policy replay counts passes right."""

import json
import os
import subprocess
import sys

import deps
from benchmarks import decode_speculative as spec
from benchmarks.lookup_policy import replay
from infer.drafts import lookup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick(name):
  deps.smollm()  # the benchmarks' model; the self-instruct data is in the repository
  proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", name), "--json",
                         "--quick"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout)
  assert not result.get("skipped"), f"{name} skipped: {result['reason']}"
  return result


def test_replay_counts_the_passes_greedy_lookup_makes():
  """By hand: after [7 8 9 7 8] the 2-gram [7 8] recurs, drafts [9 7], both kept (a pass of
  3 tokens, 3 new); then the 3-gram [9 7 8] drafts [9 7], one kept: 2 passes, cost 2 + 2."""
  prompt, out = [7, 8, 9, 7, 8], [9, 7, 8, 9, 5]
  assert lookup(prompt, 2, 3) == [9, 7] and lookup(prompt + out[:3], 2, 3) == [9, 7]
  assert replay([(prompt, out)], 2, 3, 1, {1: 1.0, 3: 2.0}) == (2, 4.0)
  # 3-grams only: a miss (one token, cost 1), then [7 8 9] drafts [7 8], both kept, then
  # [7 8 9] again drafts [7 8] against the 5: none kept.
  assert replay([(prompt, out)], 2, 3, 3, {1: 1.0, 3: 2.0}) == (3, 5.0)


def test_decode_speculative_quick_emits_json():
  result = _quick("decode_speculative.py")
  assert result["quick"] is True and result["equal_output"] is True
  lookup_side = result["methods"]["prompt_lookup"]
  assert (lookup_side["gamma"], lookup_side["max_ngram"], lookup_side["min_ngram"]) == (6, 4, 2)
  assert lookup_side["timed_rounds"] == 1 and lookup_side["tokens"] > 0
  assert len(result["per_round_speedup"]) == 1 and result["per_round_speedup"][0] > 0
  assert len(lookup_side["per_position_rate"]) == 6
  assert 0 < lookup_side["target_passes"] <= lookup_side["tokens"]
  for name in ("plain", "no_draft", "prompt_lookup"):
    assert result["methods"][name]["tokens_per_s"] > 0
  assert result["target_ratio"] == 1.5 and isinstance(result["target_met"], bool)


def test_lookup_policy_quick_emits_json():
  result = _quick("lookup_policy.py")
  assert len(result["held_out"]["prompts"]) == 3 and result["held_out"]["tokens"] > 0
  with open(spec._data_path()) as f:  # the benchmark's own prompts, by its rule
    rows = [json.loads(line) for line in f if line.strip()]
  own = [r["id"] for r in rows if len(r["instances"][0]["input"]) >= spec.MIN_INPUT_CHARS][:3]
  assert len(own) == 3 and not set(own) & set(result["held_out"]["prompts"])
  assert result["relative_cost"]["1"] == 1.0 and len(result["policies"]) == 3 * 4
  assert result["best"] == max(result["policies"], key=lambda r: r["predicted_speedup"])
  for row in result["policies"]:
    assert row["passes"] > 0 and row["predicted_speedup"] > 0
