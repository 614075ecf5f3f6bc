"""The encoder, encoder-decoder and prefix-LM under the FSDP and tensor-parallel layouts.

One worker process (8 fake CPU devices, tests/workers/arch_layouts.py) trains
each architecture 10 steps on one device and under every layout in LAYOUTS;
the tests compare losses and final parameters with one device, and check from
the parameters' shardings that each layout really split the weights.
"""

import json

import numpy as np
import pytest

from conftest import run_worker

ARCHS = ["encoder", "encoder_decoder", "prefix_lm"]
LAYOUTS = [
    "fsdp:fsdp=8",
    "tensor:data=2,tensor=4",
    "fsdp+tensor:data=2,fsdp=2,tensor=2",
]
# BERT's key bias adds q.bk to all of a query's scores, which the softmax cancels: its
# gradient is rounding noise (test_key_bias_gradient_is_rounding_noise), and AdamW turns
# noise into full-size steps, so its values differ between layouts and say nothing.
NO_GRADIENT = ("bk_KH",)
# Per strategy: parameter name -> (dimension counted from the end, mesh axis that must split
# it). Every parameter of that name (each stack, self- and cross-attention) is checked.
MUST_SPLIT = {
    "fsdp": {"embed_VD": (-1, "fsdp"), "wq_DNH": (-3, "fsdp"), "wk_DKH": (-3, "fsdp"),
             "wo_NHD": (-1, "fsdp"), "up_DF": (-2, "fsdp"), "down_FD": (-1, "fsdp"),
             "pos_PD": (-1, "fsdp"), "type_YD": (-1, "fsdp")},
    "tensor": {"embed_VD": (-2, "tensor"), "wq_DNH": (-2, "tensor"), "wk_DKH": (-2, "tensor"),
               "wv_DKH": (-2, "tensor"), "wo_NHD": (-3, "tensor"), "up_DF": (-1, "tensor"),
               "down_FD": (-2, "tensor"), "bq_NH": (-2, "tensor"), "table_RN": (-1, "tensor"),
               "unembed_DV": (-1, "tensor")},
}


@pytest.fixture(scope="module")
def arch_results(tmp_path_factory):
  """Every architecture under every layout, trained once per module."""
  path = str(tmp_path_factory.mktemp("arch_layouts") / "results.json")
  run_worker("arch_layouts.py", path, *LAYOUTS)
  with open(path) as f:
    return json.load(f)


def _name(path: str) -> str:
  """"['blocks']['attn']['wq_DNH'].value" -> "wq_DNH"."""
  return path.rsplit("['", 1)[1].split("']")[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_ten_steps_match_one_device(arch_results, arch, layout):
  result = arch_results[f"{arch}/{layout}"]
  base = np.asarray(arch_results[f"{arch}/single_device"]["losses"])
  got = np.asarray(result["losses"])
  assert len(got) == len(base) == 10
  np.testing.assert_allclose(got, base, rtol=1e-5)
  diffs = {k: v for k, v in result["param_rel_diff"].items() if _name(k) not in NO_GRADIENT}
  worst = max(diffs.items(), key=lambda kv: kv[1])
  print(f"\n{arch} {layout}: worst parameter rel diff after 10 steps {worst[1]:.2e} ({worst[0]})")
  assert worst[1] <= 1e-5, worst


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_layout_splits_the_weights(arch_results, arch, layout):
  specs = arch_results[f"{arch}/{layout}"]["param_specs"]
  for strategy in layout.split(":")[0].split("+"):
    seen = set()
    for path, spec in specs.items():
      if _name(path) in MUST_SPLIT[strategy]:
        dim, axis = MUST_SPLIT[strategy][_name(path)]
        entry = spec[dim] if isinstance(spec[dim], list) else [spec[dim]]
        assert axis in entry, f"{arch} {layout}: {path} has spec {spec}; dim {dim} not on {axis}"
        seen.add(_name(path))
    # Every architecture has these; a renamed parameter must not slip past unchecked.
    assert {"embed_VD", "wq_DNH", "wo_NHD", "up_DF", "down_FD"} <= seen, (strategy, seen)


def test_key_bias_gradient_is_rounding_noise(arch_results):
  norms = arch_results["bias_gradients"]
  assert norms["bk_KH"] < 1e-5 * min(norms["bq_NH"], norms["bv_KH"]), norms
