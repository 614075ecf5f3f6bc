"""Golden shardings and collectives for each new family mechanism (tests/workers/
family_layouts.py): soft-capping and local/global layers (Gemma 2), q/k norms with two RoPE
bases (Gemma 3), a gated shared expert (Qwen2-MoE), a q/k norm across heads (OLMoE), latent
attention (DeepSeek) and DeepSeek-V3's grouped sigmoid routing with a dense first block, each
compiled on 8 CPU devices, and its parameters after 10 steps equal to one device's.

Regenerate after an intended change, and review the diff of tests/golden/families/:
  MESHLM_UPDATE_GOLDEN=1 python -m pytest tests/test_family_layouts.py
"""

import json
import os

import pytest

from conftest import REPO, build_once, run_worker

GOLDEN = os.path.join(REPO, "tests", "golden", "families")
UPDATE = os.environ.get("MESHLM_UPDATE_GOLDEN") == "1"
NAMES = ["gemma2", "gemma3", "qwen2_moe", "olmoe", "mla", "deepseek_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  path = build_once(tmp_path_factory, "family_layouts", lambda d: run_worker(
      "family_layouts.py", os.path.join(d, "family_layouts.json")))
  with open(os.path.join(path, "family_layouts.json")) as f:
    out = json.load(f)
  if UPDATE:
    os.makedirs(GOLDEN, exist_ok=True)
    for name, r in out.items():
      with open(os.path.join(GOLDEN, f"{name}.json"), "w") as f:
        json.dump(r["golden"], f, indent=1, sort_keys=True)
        f.write("\n")
  return out


@pytest.mark.parametrize("name", NAMES)
def test_matches_golden(results, name):
  with open(os.path.join(GOLDEN, f"{name}.json")) as f:
    golden = json.load(f)
  got = results[name]["golden"]
  for key in ("layout", "mesh", "params", "activations", "collectives"):
    assert got[key] == golden[key], (
        f"{name}: {key} changed\n golden: {golden[key]}\n now:    {got[key]}\n"
        "If intended: MESHLM_UPDATE_GOLDEN=1 python -m pytest tests/test_family_layouts.py")


# The key bias adds q·b_k to every score of a query alike, which the softmax ignores: its
# gradient is zero but for rounding, which AdamW scales up to lr-sized steps of noise.
NOISE_ONLY = ("['blocks']['attn']['bk_KH'].value",)


@pytest.mark.parametrize("name", NAMES)
def test_trains_like_one_device(results, name):
  r = results[name]
  worst = max(((k, v) for k, v in r["param_rel_diff"].items() if k not in NOISE_ONLY),
              key=lambda kv: kv[1])
  assert worst[1] <= 1e-5, worst
  assert r["losses"] == pytest.approx(r["base_losses"], rel=1e-5)
