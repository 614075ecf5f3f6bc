"""The Engine and PagedEngine on 8 fake CPU devices: a sharded model and a sharded KV cache
generate what one device generates (tests/workers/sharded_engine.py)."""

import json
import os

import numpy as np
import pytest
from conftest import build_once, run_worker

LOGPROB_TOL = 1e-5  # float32; sharding only changes summation order (as tests/test_kv_cache.py)
LAYOUTS = ["data_parallel:data=8", "tensor:data=4,tensor=2",
           "fsdp+tensor:data=2,fsdp=2,tensor=2"]
# The cache's keys [L, B, S, K, H]: rows over the batch axes, kv heads over `tensor`.
CACHE_K_SPECS = {LAYOUTS[0]: "P(None, 'data')", LAYOUTS[1]: "P(None, 'data', None, 'tensor')",
                 LAYOUTS[2]: "P(None, ('data', 'fsdp'), None, 'tensor')"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  path = build_once(tmp_path_factory, "sharded_engine", lambda d: run_worker(
      "sharded_engine.py", os.path.join(d, "out.json"), *LAYOUTS))
  with open(os.path.join(path, "out.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("engine", ["engine", "paged"])
def test_sharded_generation_matches_one_device(results, layout, engine):
  one, sharded = results["single_device"][engine], results[layout][engine]
  assert sharded["tokens"] == one["tokens"]
  for got, want in zip(sharded["logprobs"], one["logprobs"]):
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cache_and_parameters_are_sharded_by_the_layout(results, layout):
  row = results[layout]
  assert row["cache_specs"]["k"] == CACHE_K_SPECS[layout]
  if "tensor" in layout:  # some projection is split over `tensor`
    assert any("tensor" in spec for spec in row["param_specs"])


def test_prefill_is_packed_only_where_the_batch_is_not_split(results):
  assert results["single_device"]["packed_prefill"]
  for layout in LAYOUTS:  # every layout here splits the batch over data (and fsdp)
    assert not results[layout]["packed_prefill"]
