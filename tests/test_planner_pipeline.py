"""The planner on circular pipelines: estimate vs XLA's compiled peak for small llama_70b_pods.

The layouts keep experiments/llama_70b_pod.py's structure (circular schedule, 2
repeats, 8-16 microbatches, remat, bfloat16 compute over float32 parameters)
at toy sizes. XLA:CPU runs the bfloat16 math in float32, so each compiled
peak is compared with the estimate at float32 compute, like for like, as
`meshlm plan --compile` does. The 256-device one has the 70B's own mesh
(pipeline 4 x fsdp 8 x tensor 8, sequence parallel), where the loss once
compiled to 3.9x its estimate: XLA's SPMD partitioner all-gathered the
logits' gradient over the batch axes (train/step.py `token_losses`,
models/embedding.py `unembed`). Each group compiles in one worker process
(tests/workers/planner_compile.py), about 20 s per group on two cores.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, device_env
from experiments import llama_70b_pod
from train.plan import report as plan_report
from train.plan.planner import Planner

PIPE = "pipeline+fsdp"
PIPE_SP = "pipeline+fsdp+tensor+sequence"
# (devices, config overrides, [(sharding, mesh, remat)]): one worker process per group.
GROUPS = {
    "8": (8, dict(batch_size=32, microbatches=8, num_layers=16, d_model=256, num_heads=8,
                  num_kv_heads=4, mlp_dim=512, vocab_size=1024),
          [(PIPE, "fsdp=2,pipeline=4", "full"), (PIPE, "fsdp=2,pipeline=4", "dots"),
           (PIPE_SP, "fsdp=2,tensor=2,pipeline=2", "full")]),
    "256": (256, dict(batch_size=128, microbatches=16, num_layers=8, d_model=512, num_heads=8,
                      num_kv_heads=8, mlp_dim=1024, vocab_size=8192),
            [(PIPE_SP, "fsdp=8,tensor=8,pipeline=4", "full")]),
}
CASES = [(g, spec) for g, (_, _, specs) in GROUPS.items() for spec in specs]


def small_pod(batch_size, microbatches, num_layers, d_model, num_heads, num_kv_heads, mlp_dim,
              vocab_size, remat="full"):
  """llama_70b_pod's config at toy sizes: 256 positions, the pod's pipeline schedule."""
  c = llama_70b_pod.get_config()
  c.batch_size, c.seq_len, c.grad_accum = batch_size, 256, 1
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = num_layers, d_model, num_heads, num_kv_heads
  m.mlp_dim, m.vocab_size, m.max_seq_len, m.remat = mlp_dim, vocab_size, 256, remat
  c.pipeline.microbatches = microbatches
  assert (c.pipeline.schedule, c.pipeline.repeats, m.dtype) == ("circular", 2, "bfloat16")
  return c


def _sizes(mesh):
  return {k: int(v) for k, v in (p.split("=") for p in mesh.split(","))}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("plan_pipeline")
  results = {}
  for group, (devices, sizes, specs) in GROUPS.items():
    config_path, out_path = tmp / f"config{group}.json", tmp / f"out{group}.json"
    config_path.write_text(json.dumps(small_pod(**sizes).to_dict()))
    out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "workers",
                                                       "planner_compile.py"),
                          str(out_path), str(config_path), *(":".join(s) for s in specs)],
                         env=device_env(devices, JAX_PLATFORMS="cpu"), cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    for key, value in json.loads(out_path.read_text()).items():
      results[(group, tuple(key.split(":")))] = value
  return results


@pytest.mark.parametrize("group,spec", CASES, ids=[f"{g}:{':'.join(s)}" for g, s in CASES])
def test_pipeline_estimate_within_20_percent_of_compiled_peak(compiled, group, spec):
  sharding, mesh, remat = spec
  planner = Planner(small_pod(**GROUPS[group][1], remat=remat))
  est = planner.estimate(_sizes(mesh), sharding, compute_dtype="float32")
  got = compiled[(group, spec)]
  assert est["pipeline"]["repeats"] == 2 and est["activations"]["pipeline_weights"] > 0
  ratio = est["memory"]["total"] / got["peak"]
  assert 0.8 <= ratio <= 1.2, (ratio, est["activations"], got)


def test_verdict_rests_on_the_compiled_peak_and_says_so():
  """Without a compile the estimate decides; with one the compiled peak does, and a bfloat16
  model's verdict says the compile ran its math in float32 and what the estimate says."""
  gib = 2 ** 30
  v = plan_report.budget_verdict(80, 60 * gib, None, "bfloat16")
  assert v["fits"] and v["basis"] == "estimate"
  assert plan_report.format_verdict(80, v) == "budget 80 GiB: fits (estimate 60.00 GiB)"
  v = plan_report.budget_verdict(80, 60 * gib, {"peak": 90 * gib}, "bfloat16")
  assert not v["fits"] and v["basis"] == "compiled peak"
  text = plan_report.format_verdict(80, v)
  assert text.startswith("budget 80 GiB: does not fit (compiled peak 90.00 GiB; XLA:CPU running "
                         "bfloat16 math in float32; the bfloat16 estimate, 60.00 GiB, fits but "
                         "no compile checks it)"), text
  v = plan_report.budget_verdict(80, 90 * gib, {"peak": 70 * gib}, "float32")
  assert v["fits"] and plan_report.format_verdict(80, v) == \
      "budget 80 GiB: fits (compiled peak 70.00 GiB)"
