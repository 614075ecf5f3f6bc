"""`meshlm plan`'s cost per token: `cost_estimate` by hand, and the CLI's "cost" object."""

import json
import os

import pytest

from cli import plan as plan_cmd
from conftest import REPO
from train.plan.cost import comm_split, cost_estimate

POD_8B = os.path.join(REPO, "experiments", "llama3_8b_pod.py")
# 1e15 FLOP on 4 devices of 100 TFLOP/s at 50% MFU; 1e10 bytes at 10 GB/s; 6000 tokens.
BASE = dict(step_flops=1e15, tokens_per_step=6000, comm_bytes=1e10, devices=4, peak_tflops=100,
            mfu=0.5, bandwidth_gbps=10, price_per_device_hour=3.0, watts_per_device=500,
            usd_per_kwh=0.15, pue=1.2)


def test_cost_by_hand():
  c = cost_estimate(**BASE)
  assert c["compute_seconds"] == pytest.approx(1e15 / (4 * 1e14 * 0.5))  # 5 s
  assert c["comm_seconds"] == pytest.approx(1e10 / 10e9)  # 1 s
  assert c["step_seconds"] == pytest.approx(5 + 1)  # no overlap by default
  assert c["tokens_per_second"] == pytest.approx(6000 / 6)  # 1000
  assert c["tokens_per_day"] == pytest.approx(1000 * 86400)
  # 1M tokens = 1e6 / 6000 = 166.7 steps of 6 s on 4 devices = 4000 device-seconds.
  device_hours = 4 * 6 / 3600 * (1e6 / 6000)  # 1.1111
  assert c["device_hours_per_million_tokens"] == pytest.approx(device_hours)
  kwh = device_hours * 500 / 1000 * 1.2  # 0.6667
  assert c["kwh_per_million_tokens"] == pytest.approx(kwh)
  assert c["device_usd_per_million_tokens"] == pytest.approx(device_hours * 3.0)  # 3.3333
  assert c["energy_usd_per_million_tokens"] == pytest.approx(kwh * 0.15)  # 0.1
  assert c["usd_per_million_tokens"] == pytest.approx(3.3333 + 0.1, abs=1e-3)


def test_overlap_and_intra_host_links():
  half = cost_estimate(**BASE, overlap=0.5)
  assert half["hidden_seconds"] == pytest.approx(0.5) and half["step_seconds"] == pytest.approx(5.5)
  full = cost_estimate(**dict(BASE, comm_bytes=8e10), overlap=1.0)  # comm 8 s > compute 5 s
  assert full["step_seconds"] == pytest.approx(max(5, 8))
  both = cost_estimate(**BASE, intra_comm_bytes=9e10, intra_host_gbps=90)  # + 1 s inside a host
  assert both["comm_seconds"] == pytest.approx(2) and both["step_seconds"] == pytest.approx(7)
  given = cost_estimate(**BASE, step_seconds=12.0)
  assert given["step_seconds"] == 12.0 and given["estimated_step_seconds"] == pytest.approx(6)
  assert given["tokens_per_second"] == pytest.approx(500)


@pytest.mark.parametrize("name,value,match", [
    ("mfu", 0.0, "--mfu=0.0"), ("mfu", 1.5, "--mfu=1.5"), ("devices", 0, "--devices=0"),
    ("peak_tflops", -1.0, "--peak_tflops=-1.0"), ("bandwidth_gbps", 0.0, "--bandwidth_gbps=0.0"),
    ("price_per_device_hour", -2.0, "--price_per_device_hour=-2.0"),
    ("watts_per_device", float("nan"), "--watts_per_device=nan"), ("overlap", 1.1, "--overlap=1.1"),
    ("pue", 0.9, "--pue=0.9"), ("tokens_per_step", 0, "--tokens_per_step=0")])
def test_bad_inputs_name_the_value(name, value, match):
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    cost_estimate(**dict(BASE, **{name: value}))


def test_comm_split_follows_mesh_order():
  # MESH_AXES order puts expert inside fsdp: expert=8 spans 8 adjacent devices, fsdp=8 spans 64.
  est = dict(mesh={"fsdp": 8, "expert": 8}, comm=[
      dict(axes="fsdp", bytes=3), dict(axes="expert", bytes=5), dict(axes="expert+fsdp", bytes=7)])
  assert comm_split(est, devices_per_host=8) == (10, 5)
  assert comm_split(est, devices_per_host=64) == (0, 15)


def test_cli_json_cost(capsys):
  plan_cmd.main(["--config", POD_8B, "--devices", "64", "--json", "--nosuggest",
                 "--price_per_device_hour", "2.5", "--watts_per_device", "700"])
  c = json.loads(capsys.readouterr().out)["cost"]
  for key in ("compute_seconds", "comm_seconds", "step_seconds", "tokens_per_second",
              "tokens_per_day", "device_hours_per_million_tokens", "usd_per_million_tokens",
              "kwh_per_million_tokens", "mfu", "peak_tflops", "bandwidth_gbps", "overlap",
              "price_per_device_hour", "watts_per_device"):
    assert key in c, key
  assert c["tokens_per_day"] == pytest.approx(c["tokens_per_second"] * 86400)
  assert c["tokens_per_step"] == 256 * 8192 and c["devices"] == 64
  assert c["step_seconds"] == pytest.approx(c["compute_seconds"] + c["comm_seconds"])
  with pytest.raises(SystemExit, match="--mfu=1.5"):
    plan_cmd.main(["--config", POD_8B, "--devices", "64", "--nosuggest", "--mfu", "1.5"])
