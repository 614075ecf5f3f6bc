"""Layouts on an 8-device fake CPU mesh: equivalence with one device, memory, clear errors.

Each test that needs 8 devices runs a worker in its own process, because
XLA_FLAGS must be set before JAX starts.
"""

import jax
import numpy as np
import pytest

import parallel
from conftest import LAYOUTS, run_worker
from models import ModelConfig

@pytest.mark.parametrize("layout", LAYOUTS)
def test_ten_steps_match_one_device(layout_results, layout):
  # Each layout against one device training the same model (dense, or MoE for `expert`).
  result = layout_results[layout]
  base = np.asarray(layout_results[result["baseline"]]["losses"])
  got = np.asarray(result["losses"])
  assert len(got) == len(base) == 10
  np.testing.assert_allclose(got, base, rtol=1e-5)
  worst = max(result["param_rel_diff"].items(), key=lambda kv: kv[1])
  print(f"\n{layout}: worst parameter rel diff after 10 steps {worst[1]:.2e} ({worst[0]})")
  assert worst[1] <= 1e-5, worst


def test_fsdp_shards_parameters_and_optimizer_state():
  run_worker("fsdp_memory.py")


def test_mesh_that_does_not_divide_devices():
  with pytest.raises(ValueError, match="fix 3 devices, which does not divide the 1 devices"):
    parallel.make_mesh({"data": -1, "tensor": 3})
  with pytest.raises(ValueError, match="has 2 devices but 1 are available"):
    parallel.make_mesh({"data": 2})
  with pytest.raises(ValueError, match="unknown mesh axes \\['model'\\]"):
    parallel.make_mesh({"model": 1})


def test_tensor_axis_not_dividing_heads_names_the_sizes():
  from train.state import split_abstract_model
  cfg = ModelConfig(vocab_size=64, d_model=48, num_layers=1, num_heads=3, num_kv_heads=3,
                    mlp_dim=64)
  _, params = split_abstract_model(cfg)
  mesh = jax.sharding.AbstractMesh((1, 1, 2, 1, 1, 1), parallel.MESH_AXES)
  with pytest.raises(ValueError, match=r"\((kv_)?heads\) of size 3 is not divisible by mesh axes "
                                       r"\('tensor',\) of total size 2"):
    parallel.logical_shardings(params, mesh, parallel.get_rules("tensor"))


def test_unknown_strategy():
  with pytest.raises(ValueError, match="unknown sharding strategy \\['tensr'\\]"):
    parallel.get_layout("fsdp+tensr")


def test_platform_is_the_meshs_not_the_hosts():
  """parallel.platform reads the devices of the mesh a computation is traced under; outside
  any mesh, the default devices'. (TPU meshes: tests/test_tpu_compile.py.)"""
  assert parallel.platform() == jax.devices()[0].platform == "cpu"
  mesh = parallel.make_mesh({"data": 1}, jax.devices()[:1])
  assert parallel.platform(mesh) == "cpu" and parallel.device_kind(mesh) == "cpu"
  seen = []

  @jax.jit
  def f(x):
    seen.append(parallel.platform())  # at trace time, under the surrounding mesh
    return x + 1

  with jax.set_mesh(mesh):
    f(np.ones(2))
  assert seen == ["cpu"]
  bare = jax.sharding.AbstractMesh((1,), ("data",))  # no device kind: the default devices'
  assert parallel.platform(bare) == "cpu"
