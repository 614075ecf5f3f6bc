"""Expert parallelism on an 8-device fake CPU mesh matches one device.

A tiny MoE model (tests/workers/layouts.py MOE_MODEL: 8 experts, top-2) under
the `expert` layouts gives the same logits, gradients of the training loss and
10-step losses as one device, and its compiled step exchanges tokens with
all-to-all. Forward/gradient checks and the capacity path's training run in
tests/workers/moe_parallel.py; the dropless layouts' 10 steps are the
conftest.LAYOUTS run shared with tests/test_parallel.py and tests/test_golden.py.
Tolerances are those of the dense layouts (tests/test_parallel.py) and the
pipeline (tests/test_pipeline.py): float32 reduction order only, including
parameters after 10 AdamW steps (<= 1e-5 relative).
"""

import json

import numpy as np
import pytest

from conftest import EXPERT_LAYOUTS, run_worker

FORWARD_CASES = ["dropless_expert", "dropless_fsdp_expert", "capacity_expert",
                 "capacity_drops_expert", "capacity_drops_sequence_expert"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("moe") / "moe.json")
  run_worker("moe_parallel.py", path)
  with open(path) as f:
    return json.load(f)


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_logits_and_gradients_match_one_device(results, case):
  r = results[case]
  worst = max(r["grads"].items(), key=lambda kv: kv[1])
  print(f"\n{case}: logits rel {r['logits']['rel']:.2e} abs {r['logits']['abs']:.2e}, "
        f"worst grad rel {worst[1]:.2e} ({worst[0]})")
  assert r["logits"]["allclose"], r["logits"]  # rtol=1e-5, atol=1e-6, elementwise
  assert r["logits"]["rel"] <= 1e-5, r["logits"]
  assert worst[1] <= 1e-5, worst
  assert r["dropped"] == r["base_dropped"]


def test_capacity_drops_only_when_capacity_is_short(results):
  assert results["capacity_expert"]["base_dropped"] == 0
  assert results["capacity_expert"]["dropped"] == 0
  # Capacity factor 1: some choices drop, the same ones as on one device (checked above).
  assert results["capacity_drops_expert"]["base_dropped"] > 0


def test_capacity_ten_steps_match_one_device(results):
  r = results["capacity_expert"]
  np.testing.assert_allclose(r["losses"], r["base_losses"], rtol=1e-5)
  worst = max(r["param_rel_diff"].items(), key=lambda kv: kv[1])
  print(f"\ncapacity_expert: worst parameter rel diff after 10 steps {worst[1]:.2e}")
  assert worst[1] <= 1e-5, worst
  assert r["drop_rate"] == [0.0] * 10
  # Every expert gets tokens, so tokens do cross devices.
  assert min(r["base_loads"]) > 0, r["base_loads"]
  c = r["collectives"]
  assert c["moe all-to-all forward"] > 0 and c["moe all-to-all backward"] > 0, c


@pytest.mark.parametrize("layout", EXPERT_LAYOUTS)
def test_dropless_ten_steps_match_one_device(layout_results, layout):
  r = layout_results[layout]
  assert r["baseline"] == "single_device_moe"
  np.testing.assert_allclose(r["losses"], layout_results["single_device_moe"]["losses"],
                             rtol=1e-5)
  assert r["moe_all_to_all"]["forward"] > 0 and r["moe_all_to_all"]["backward"] > 0
