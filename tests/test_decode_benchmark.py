"""Smoke tests for benchmarks/decode.py and decode_split.py: quick runs emit the JSON they
promise."""

import json
import os
import subprocess
import sys

import deps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "decode.py")
ROW_KEYS = ("1_kv_cache_vs_recompute", "2_vs_transformers", "3_continuous_vs_static",
            "4_speculative", "5_paged_memory")


def test_decode_benchmark_quick_rows_1_and_2_emit_json():
  for module in ("torch", "transformers"):  # row 2's baseline
    deps.require(module)
  proc = subprocess.run([sys.executable, SCRIPT, "--json", "--quick", "--rows", "1,2"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
  assert result["quick"] is True and result["rows_selected"] == ["1", "2"]
  for key in ("jax", "flax", "device_kind", "cpu_count", "loadavg_1m"):
    assert key in result["env"]
  rows = result["rows"]
  assert set(rows) == set(ROW_KEYS)
  for key in ROW_KEYS[2:]:  # not selected
    assert rows[key]["skipped"] and rows[key]["reason"]

  kv = rows["1_kv_cache_vs_recompute"]
  assert set(kv["per_n"]) == {"16", "32"} and kv["growth_n"] == [16, 32]
  for point in kv["per_n"].values():
    for key in ("kv_cache_tokens_per_s", "kv_cache_sized_tokens_per_s", "recompute_tokens_per_s",
                "ratio_cache_over_recompute"):
      assert point[key] > 0, key
    assert point["recompute_buffer_len"] % 64 == 0
  for key in ("kv_cache_time_per_token_growth", "recompute_time_per_token_growth"):
    assert kv[key] > 0
  assert kv["equal_output"] is True  # the cache changes summation order, not greedy tokens
  assert kv["engine_max_seq_len"] >= kv["prompt_tokens"] + 32

  hf = rows["2_vs_transformers"]
  assert not hf.get("skipped"), hf["reason"]  # torch is installed (above): a bug
  assert hf["target_ratio"] == 2.0 and hf["engine_max_seq_len"] > 0 and hf["torch_threads"] >= 1
  assert set(hf["cases"]) == {"small_ref_b1", "small_ref_b8"}  # quick: no SmolLM2
  for name, case in hf["cases"].items():
    assert case["batch"] == (1 if name.endswith("b1") else 8)
    assert case["generated_tokens"] == case["batch"] * case["new_tokens_per_row"]
    assert case["meshlm"]["tokens_per_s"] > 0 and case["transformers"]["tokens_per_s"] > 0
    assert case["ratio"] > 0 and isinstance(case["target_met"], bool)
    assert len(case["greedy_common_prefix"]) == case["batch"]
    assert all(0 <= n <= case["new_tokens_per_row"] for n in case["greedy_common_prefix"])
  assert isinstance(hf["all_targets_met"], bool)


def test_decode_benchmark_quick_serving_rows_emit_json():
  proc = subprocess.run([sys.executable, SCRIPT, "--json", "--quick", "--rows", "3,5"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(proc.stdout)["rows"]
  serving, memory = rows["3_continuous_vs_static"], rows["5_paged_memory"]
  assert serving["requests"] == 16 and sum(serving["sources"].values()) == 16
  assert serving["equal_output"] is True  # same model, same greedy tokens, either server
  for name in ("static", "continuous"):
    side = serving[name]
    assert side["requests_per_s"] > 0 and side["ttft_s"]["p50"] <= side["ttft_s"]["p99"]
  assert serving["continuous"]["counters"]["finished"] == 16
  walls = serving["wall_s_per_round"]  # two timed rounds per side, the ratio of their sums
  assert len(walls["static"]) == len(walls["continuous"]) == len(serving["ratio_per_round"]) == 2
  assert abs(serving["ratio_throughput"] - sum(walls["static"]) / sum(walls["continuous"])) < 1e-9
  assert serving["continuous"]["prefix_caching"] is False
  assert serving["continuous_prefix_cache"]["prefix_caching"] is True
  # The small pool really is smaller, and serves the same tokens.
  assert memory["small_pool"]["num_blocks"] < serving["continuous"]["num_blocks"]
  assert memory["small_pool_bytes"] < 0.41 * memory["max_length_bytes"]
  assert memory["small_pool_equal_output"] is True
  assert memory["target_saving"] == 0.5 and isinstance(memory["target_met"], bool)


def test_decode_split_quick_matmuls_emit_json():
  script = os.path.join(REPO, "benchmarks", "decode_split.py")
  proc = subprocess.run([sys.executable, script, "--json", "--quick"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout)
  assert result["layers"] == 2 and result["vocab"] == 4096 and result["repeats"] == 1
  assert "split" not in result
  assert set(result["matmuls_ms"]) == {"b1", "b8"}
  for case in result["matmuls_ms"].values():
    for key in ("scan", "unrolled", "scan_layers_only", "head_only", "torch",
                "torch_layers_only", "torch_head_only", "torch_over_scan"):
      assert case[key] > 0, key
  tiles = result["tiles"]
  assert tiles["tile"] > 0 and set(tiles) == {"tile", "small_ref"}
  small = tiles["small_ref"]
  # the benchmark raises unless the two engines' log-probabilities differ (two kernels ran)
  assert small["same_first_tokens"] is True and 0 < small["max_first_logprob_diff"] < 1e-5
  assert small["prefill_ms"]["tiles"] > 0 and small["prefill_ms"]["naive"] > 0
  assert set(result["steps"]) == {"small_ref_b1", "small_ref_b8"}
  for case in result["steps"].values():  # the benchmark raises if the two engines' tokens differ
    assert case["decode_steps"] == {"one_per_call": 1, "default": 16} and case["same_tokens"]
    assert case["generate_ms"]["default"] > 0 and case["paired_ratio_median"] > 0
  assert set(result["unroll"]) == {"small_ref_b1", "small_ref_b8"}
  for case in result["unroll"].values():  # raises if the tokens differ
    assert case["unroll_layers"] == {"scan": False, "unrolled": True} and case["same_tokens"]
    assert case["max_logprob_diff"] < 1e-5 and case["paired_ratio_median"] > 0
