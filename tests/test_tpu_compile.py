"""Deviceless compiles for a real TPU slice (libtpu, no TPU attached): the steps are compiled
by the TPU's own compiler, with the TPU's kernels chosen from the mesh's devices.

Each compile runs in a subprocess that shares libtpu's lockfile (ALLOW_MULTIPLE_LIBTPU_LOAD);
they are CPU-heavy (the pod configs take 45-80 s each), so they run in the serial tier.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import LAYOUTS, run_worker
from deps import require

import parallel
from experiments import llama3_8b_pod, llama_70b_pod, mixtral_8x7b_pod, moe_shakespeare, quickstart
from infer import compile_decode
from train.plan import compile_target, targets
from train.plan.planner import Planner
from train.plan.report import plan

require("libtpu")
pytestmark = pytest.mark.serial
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
GOLDEN_TPU = os.path.join(REPO, "tests", "golden", "tpu")
TARGET = "v5e:2x2"  # the smallest v5e slice libtpu names: 4 chips of 16 GiB


def test_quickstart_train_step_compiles_for_a_tpu_with_pallas_attention():
  raw = compile_target.compile_in_subprocess(quickstart.get_config(), TARGET, {"data": 4},
                                             "data_parallel", timeout=600)
  assert raw["platform"] == "tpu" and raw["device_kind"].startswith("TPU v5")
  assert raw["devices"] == 4
  # splash attention forward and backward: the host (a CPU) did not choose the kernels
  assert targets.pallas_kernels(raw["kernels"]) >= 2, raw["kernels"]
  # 0.9M parameters, float32 Adam state, 4 rows of 128 tokens per chip: ~10 MiB
  assert 0 < raw["peak"] < 64 * 2 ** 20, raw
  # the probes: 1 and 2 unrolled layers, extrapolated to 4 layers
  cost, one, two = raw["step_cost"], raw["probes"]["1"], raw["probes"]["2"]
  assert two["flops"] > one["flops"] > 0
  assert cost["flops"] == pytest.approx(one["flops"] + 3 * (two["flops"] - one["flops"]))


def test_moe_train_step_compiles_for_a_tpu_with_the_grouped_matmul():
  config = moe_shakespeare.get_config()
  config.model.num_layers = 2
  raw = compile_target.compile_in_subprocess(config, TARGET, {"fsdp": 2, "expert": 2},
                                             "fsdp+expert", probes=False, timeout=600)
  assert raw["platform"] == "tpu" and targets.pallas_kernels(raw["kernels"]) >= 2, raw
  assert raw["collectives"].get("all-to-all", 0) > 0, raw["collectives"]
  assert 0 < raw["peak"] < 256 * 2 ** 20, raw


def test_plan_target_compile_json_reports_the_compiled_block():
  """`meshlm plan --target --compile --json` as a user runs it."""
  run = subprocess.run(
      [sys.executable, "-m", "cli.main", "plan", "--config", "experiments/quickstart.py",
       "--target", TARGET, "--compile", "--json", "--nosuggest", "--decode",
       "--decode_batch", "2", "--decode_context", "256"],
      cwd=REPO, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout)
  c = out["compiled"]
  assert c["platform"] == "tpu" and c["target"] == TARGET and c["chips"] == 4
  assert c["hbm_gib"] == 16 and c["fits"] is True and c["peak_gib"] < 16
  assert c["kernels"]["pallas"] >= 2
  assert c["step_seconds_estimate"] > 0 and 0 < c["mfu"] < 1
  assert c["tokens_per_second_per_chip"] == pytest.approx(
      16 * 128 / c["step_seconds_estimate"] / 4)
  assert out["estimate_over_compiled"] == pytest.approx(
      out["estimate"]["memory"]["total"] / c["memory"]["peak"])
  assert out["devices"] == 4
  d = out["decode"]
  assert d["platform"] == "tpu" and (d["batch"], d["context"]) == (2, 256) and d["peak"] > 0


def test_a_budget_verdict_rests_on_the_targets_compiled_peak():
  result = plan(quickstart.get_config(), 4, budget_gb=0.001, compile_=True, do_suggest=False,
                target=TARGET)
  verdict, peak = result["verdict"], result["compiled"]["memory"]["peak"]
  assert verdict["bytes"] == peak and verdict["basis"] == f"compiled peak ({TARGET})"
  assert verdict["fits"] == (peak <= 0.001 * GiB)


def test_decode_step_compiles_for_a_tpu_with_the_paged_attention_kernel():
  config = quickstart.get_config()
  config.model.update(d_model=256, num_heads=2, num_kv_heads=2)  # head_dim 128
  out = compile_decode.compile_in_subprocess(config, TARGET, batch=2, context=256, timeout=600)
  assert out["platform"] == "tpu" and out["target"] == TARGET
  assert targets.pallas_kernels(out["kernels"]) >= 1, out["kernels"]  # paged attention
  # ~1.6M parameters in float32 + a pool of 2 x 17 pages of 16 slots x 4 layers: a few MiB
  assert 0 < out["peak"] < 64 * 2 ** 20, out
  assert out["cost"]["bytes_accessed"] > 0


def test_a_head_the_paged_kernel_cannot_tile_takes_the_gathered_path_on_tpu():
  """head_dim 32: Mosaic cannot lower the paged-attention kernel's blocks; the step still
  compiles for the TPU, through the gathered pages."""
  out = compile_decode.compile_in_subprocess(quickstart.get_config(), TARGET, batch=2,
                                             context=256, timeout=600)
  assert out["platform"] == "tpu" and targets.pallas_kernels(out["kernels"]) == 0


@pytest.mark.parametrize("module,target,xent", [(llama3_8b_pod, "v5p:4x4x4", None),
                                                (llama3_8b_pod, "v5p:4x4x4", "chunked"),
                                                (mixtral_8x7b_pod, "v5p:4x4x4", None),
                                                (llama_70b_pod, "v5p:4x8x8", None)])
def test_pod_config_compiles_for_its_target_within_20_percent_of_its_estimate(module, target,
                                                                              xent):
  """Each pod config's docstring names its target; the TPU compiler's per-chip peak fits the
  chip and the planner's TPU estimate is within 0.8-1.2 of it (45-80 s each); the 8B also
  with the chunked loss, which the planner sizes by its own formula."""
  config = module.get_config()
  if xent:
    config.model.xent = xent
  assert f"--target {target}" in module.__doc__
  chips = targets.resolve(target).chips
  raw = compile_target.compile_in_subprocess(config, target, config.mesh.to_dict(),
                                             config.sharding, probes=False, timeout=900)
  assert raw["platform"] == "tpu" and raw["devices"] == chips
  assert targets.pallas_kernels(raw["kernels"]) > 0, raw["kernels"]
  assert raw["peak"] <= targets.resolve(target).chip.hbm_gib * GiB
  est = Planner(config).estimate(config.mesh.to_dict(), config.sharding, chips, platform="tpu")
  assert 0.8 <= est["memory"]["total"] / raw["peak"] <= 1.2, (est["memory"], raw["peak"])


def test_golden_layouts_compiled_for_a_tpu():
  """The golden layouts (tests/test_golden.py, on 8 CPU devices) compiled for 8 TPU chips:
  the TPU compiler's collectives and kernels, against tests/golden/tpu/. Regenerate with
  MESHLM_UPDATE_GOLDEN=1 and review the diff like code."""
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "tpu_golden.json")
    run_worker("tpu_golden.py", path, *LAYOUTS,
               env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
    with open(path) as f:
      got = json.load(f)
  assert sorted(got) == sorted(spec.split(":")[0] for spec in LAYOUTS)
  for name, compiled in got.items():
    assert compiled["platform"] == "tpu", (name, compiled)
    path = os.path.join(GOLDEN_TPU, f"{name}.json")
    if os.environ.get("MESHLM_UPDATE_GOLDEN") == "1":
      os.makedirs(GOLDEN_TPU, exist_ok=True)
      with open(path, "w") as f:
        json.dump(compiled, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(path) as f:
      golden = json.load(f)
    assert compiled == golden, (
        f"{name}: the TPU compile changed\n golden: {golden}\n now:    {compiled}\n"
        "If intended: MESHLM_UPDATE_GOLDEN=1 python -m pytest tests/test_tpu_compile.py -k golden")


def test_quantized_matmuls_read_their_codes_once_on_a_tpu():
  """A decode row's INT8 / INT4 projection compiled for a v5e chip: no loop over slices of
  the weight, no relayout copy of its codes, no float copy of the weight; the compiler's
  bytes are those of the stored weight (the CPU path's dequantize-then-dot read 2.6x and
  11x them here: a copy of the codes and a loop of slices)."""
  out = run_worker("quant_tpu_matmul.py", "int8", "int4-g128",
                   env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                            PYTHONPATH=REPO))
  facts = json.loads(out.stdout.strip().splitlines()[-1])
  for name, f in facts.items():
    assert f["platform"] == "tpu", f
    assert f["loops"] == f["code_copies"] == f["float_weights"] == 0, (name, f)
    assert f["bytes_accessed"] <= 1.5 * f["weight_bytes"], (name, f)


def test_a_v5p_slice_is_the_wrapped_torus_and_the_mesh_follows_it():
  """compile_devices describes a slice as Cloud TPU builds it (parallel.tpu_slice) and
  make_mesh lays TPU chips out by topology: an FSDP weight gather over 64 v5p chips stays an
  all-gather (libtpu's default slice or the device list's order made it an all-reduce)."""
  assert parallel.tpu_slice("v5p:4x4x4")["wrap"] == (True, True, True)
  assert parallel.tpu_slice("v5p:2x4x4")["wrap"] == (False, False, False)
  assert parallel.tpu_slice("v5e:16x16")["wrap"] == (True, True, False)
  assert parallel.tpu_slice("v5e:2x4")["chip_config_name"] == "default"
  out = run_worker("tpu_gather.py", env=dict(os.environ, JAX_PLATFORMS="cpu",
                                             ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=REPO))
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {"all-gather": 1, "all-reduce": 0}
