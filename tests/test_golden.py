"""Golden shardings and collectives of the compiled train step, one file per layout.

A change to a rule set, the model's logical names or the step that moves a
sharding or a collective fails here until the golden files are regenerated:
  MESHLM_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
and the diff of tests/golden/ is reviewed like code.
"""

import json
import os

import pytest

from conftest import EXPERT_LAYOUTS, LAYOUTS, REPO

GOLDEN = os.path.join(REPO, "tests", "golden")
UPDATE = os.environ.get("MESHLM_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def compiled(layout_results):
  out = {spec.split(":")[0]: layout_results[spec]["golden"] for spec in LAYOUTS}
  if UPDATE:
    for name, golden in out.items():
      with open(os.path.join(GOLDEN, f"{name}.json"), "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")
  return out


def test_expert_layouts_exchange_tokens_with_all_to_all(layout_results):
  """The MoE layer's own all-to-alls (jax.lax.all_to_all in shard_map), not XLA's others."""
  for spec in LAYOUTS:
    count = layout_results[spec]["moe_all_to_all"]
    if spec in EXPERT_LAYOUTS:
      assert count["forward"] > 0 and count["backward"] > 0, (spec, count)
    else:
      assert count == {"forward": 0, "backward": 0}, (spec, count)


@pytest.mark.parametrize("layout", [spec.split(":")[0] for spec in LAYOUTS])
def test_matches_golden(compiled, layout):
  with open(os.path.join(GOLDEN, f"{layout}.json")) as f:
    golden = json.load(f)
  got = compiled[layout]
  for key in ("mesh", "params", "activations", "collectives"):
    assert got[key] == golden[key], (
        f"{layout}: {key} changed\n golden: {golden[key]}\n now:    {got[key]}\n"
        "If intended: MESHLM_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py")


def test_collectives_are_the_ones_each_strategy_needs(compiled):
  kinds = {name: set(c["collectives"]) for name, c in compiled.items()}
  # Data parallel: only gradient all-reduces.
  assert kinds["data_parallel"] == {"all-reduce"}
  # FSDP gathers parameters. (On CPU XLA keeps the gradient reduction as an
  # all-reduce; GPU/TPU passes turn it into a reduce-scatter.)
  assert "all-gather" in kinds["fsdp"]
  # Megatron tensor parallel: activation all-reduces, no parameter gathers.
  assert kinds["tensor"] == {"all-reduce"}
  assert compiled["tensor"]["collectives"]["all-reduce"] > compiled["data_parallel"]["collectives"]["all-reduce"]
  # ZeRO-1: moments sharded, so updated parameters are gathered back.
  assert "all-gather" in kinds["zero1"]
  # Pipeline stages hand activations on with collective-permutes.
  assert "collective-permute" in kinds["pipeline+fsdp"]
  # Expert parallel (MoE model): expert weights split over `expert`; tokens go to their
  # experts' devices and back with all-to-all, in the forward and the backward pass, and
  # the batch stays split (no all-gather without FSDP: routing runs per device).
  for name in (spec.split(":")[0] for spec in EXPERT_LAYOUTS):
    assert "all-to-all" in kinds[name], (name, compiled[name]["collectives"])
    experts = {k: v for k, v in compiled[name]["params"].items() if "_EDF" in k or "_EFD" in k}
    assert experts and all(v[1] == "expert" for v in experts.values()), experts
  assert kinds["expert"] == {"all-reduce", "all-to-all"}
  # Parameter shardings say the same thing directly.
  fsdp = compiled["fsdp"]["params"]
  assert all("fsdp" in json.dumps(spec) for spec in fsdp.values()), fsdp
  assert all(all(a is None for a in spec) for spec in compiled["data_parallel"]["params"].values())
