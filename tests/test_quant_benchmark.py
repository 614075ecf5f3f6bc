"""benchmarks/quant.py end to end on a briefly trained quickstart-shaped model (--quick)."""

import json
import math

from benchmarks import quant
from conftest import tiny_config
from train.loop import train


def test_quant_benchmark_quick_reports_every_format(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  train(tiny_config(steps=6, checkpoint_every=6), workdir)
  capsys.readouterr()  # the training log
  quant.main(["--json", "--quick", "--models", "quickstart", "--quickstart", workdir])
  out = json.loads(capsys.readouterr().out)
  rows = out["models"]["quickstart"]["formats"]
  assert list(rows) == [label for label, _, _ in quant.FORMATS]
  for label, row in rows.items():
    assert math.isfinite(row["ppl"]) and row["ppl"] > 1, (label, row)
    assert row["decode_tokens_per_s"] > 0 and row["decode_speed_ratio_median_round"] > 0
  assert rows["float32"]["bytes_ratio"] == 1.0
  # d_model 32, mlp 64: int4-g128 (zero-point by default) is fitted to g32 on six
  # projections, g64 on the MLP output, and the plan says so; the embedding stays int8.
  assert out["int4_kind"] == "zp"
  assert rows["int4-g128-gptq"]["groups_used"] == {"int4-g32-zp": 6, "int4-g64-zp": 1, "int8": 1}
  assert rows["int8"]["bytes_ratio"] < 0.3 and rows["int4-g32"]["bytes_ratio"] < 0.3
  for label in quant.CALIBRATED:
    assert rows[label]["groups_used"] == rows["int4-g128-gptq"]["groups_used"], label
  assert out["models"]["quickstart"]["decode_rounds"] == 1
  met = out["models"]["quickstart"]["targets_met"]
  assert set(met) >= {"int8_ppl", "calibrated_int4_ppl", "calibrated_beats_rtn_ppl"}
  assert set(met["calibrated_int4_ppl"]) == {"gptq", "awq", "awq-gptq", "awq-gptq-tuned"}
  # Engine(model, tok) against max_seq_len=512: the same length for this 512-token model.
  cache = out["models"]["quickstart"]["default_cache"]
  assert cache["same_tokens"] and cache["rounds"] == 1
  assert cache["met"] == (cache["speed_ratio_median_round"] >= quant.TARGETS[
      "default_cache_speed_ratio_min"])
  # The -a8 rows multiply in int32 dots (where they run is the benchmark's finding).
  for label in ("int8-a8", "int8-a8-smooth", "int4-g128-a8"):
    dots = rows[label]["integer_dots"]
    assert dots["int32_dots"] > 0 and dots["in_ynnpack"] + dots["xla_dots"] == dots["int32_dots"]
  assert rows["int4-g128-a8"]["format"] == "int4-g128-zp-a8"
  # Batch 8 (one generate of 8 prompts) for the float32 baseline and the listed formats.
  for label in quant.BATCHED:
    assert rows[label]["batch8_tokens_per_s"] > 0, label
  assert "batch8_tokens_per_s" not in rows["int4-g32"]
  assert met["batch8_decode"] == (max(rows[k]["batch8_speed_ratio_median_round"]
                                      for k in quant.BATCHED if k != "float32")
                                  >= quant.TARGETS["batch_decode_speed_ratio_min"])
