"""benchmarks/arch_compare.py --quick: all three architectures through the training loop."""

import math

from benchmarks import arch_compare


def test_arch_compare_quick_trains_and_scores_all_three(capsys):
  out = arch_compare.main(["--quick"])
  archs = out["archs"]
  assert list(archs) == ["decoder", "prefix_lm", "encoder_decoder"]
  assert out["max_param_ratio"] < 1.02  # equal parameter counts
  assert archs["decoder"]["params"] == archs["prefix_lm"]["params"]
  # The same held-out examples and target tokens for every architecture.
  assert len({r["examples"] for r in archs.values()}) == 1
  assert len({r["target_tokens"] for r in archs.values()}) == 1
  for arch, r in archs.items():
    # The loop's own validation loss and the benchmark's are the same quantity.
    assert math.isclose(r["val_loss"], r["loop_final_val_loss"], rel_tol=1e-5), arch
    # 4 steps from a uniform start over 320 tokens: learning has begun, far from done.
    assert r["val_loss"] < math.log(320), arch
    assert 0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0
    assert [p["step"] for p in r["curve"]] == [2, 4]
  assert '"archs"' in capsys.readouterr().out  # the one JSON document
