"""Quantized checkpoints: exact save/reload, generation from the reloaded model, atomic
writes, clear errors, and `meshlm quantize` -> `meshlm generate` end to end."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import REPO, SHAKESPEARE
from infer import Engine, SamplingParams
from models.quant import default_rules
from infer.quant import quantize_model
from infer.quant.checkpoint import load_quantized, quantized_params, save_quantized
from infer.quant.convert import calibration_ids
from models import ModelConfig
from models.transformer import Transformer
from cli.main import dispatch as main
from train.tokenizer_training import train_bpe_tokenizer
from train.workdir import save_metadata

CFG = dict(vocab_size=320, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
           max_seq_len=128)
PROMPT = "ROMEO: what"


@pytest.fixture(scope="module")
def tokenizer():
  with open(SHAKESPEARE) as f:
    return train_bpe_tokenizer([f.read()[:20_000]], 320)


_FLOAT = {}


def _model(tied=False):
  """A fresh copy of the tiny float model (built once: initialising it takes seconds)."""
  if tied not in _FLOAT:
    _FLOAT[tied] = Transformer(ModelConfig(**CFG, tie_embeddings=tied), nnx.Rngs(0))
  return nnx.clone(_FLOAT[tied])


def _quantized(fmt, tied=False):
  model = _model(tied)
  return model, quantize_model(model, default_rules(fmt))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tokenizer):
  """A training workdir as `meshlm train` leaves it, written directly (no training)."""
  path = str(tmp_path_factory.mktemp("quant") / "run")
  model = _model()
  save_metadata(path, model.cfg, tokenizer)
  directory = os.path.join(path, "checkpoints")
  with ocp.CheckpointManager(directory, item_names=("state",)) as manager:
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"params": nnx.state(model, nnx.Param)})))
    manager.wait_until_finished()
  return path


def _meshlm(*args, timeout=300):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO, env=env)


def _greedy(model, tokenizer, n=8):
  engine = Engine(model, tokenizer, max_seq_len=64, max_batch=1)
  return engine.generate([tokenizer.encode(PROMPT)], SamplingParams(max_tokens=n))[0].token_ids


@pytest.mark.parametrize("fmt,tied", [("int8", False), ("int4-g32", False),
                                      ("int4-g32-asym", True), ("int4-g32-zp", False),
                                      ("int8-a8", True), ("int4-g32-zp-a8", False)])
def test_round_trip_is_exact(tmp_path, tokenizer, fmt, tied):
  model, plan = _quantized(fmt, tied)
  out = str(tmp_path / "q")
  save_quantized(model, tokenizer, out, plan, dict(method="rtn", source="test"))
  with open(os.path.join(out, "quant.json")) as f:
    info = json.load(f)
  assert info["method"] == "rtn" and info["model_config"]["d_model"] == 64
  assert info["plan"] == {p: f.name for p, f in plan.items()}
  assert set(info["plan"].values()) == {fmt}

  loaded, tok = load_quantized(out)
  assert tok.encode(PROMPT) == tokenizer.encode(PROMPT)
  want, got = quantized_params(model), quantized_params(loaded)
  assert sorted(want) == sorted(got) == sorted(plan)
  for path, q in want.items():
    r = got[path]
    assert (r.fmt, r.letters, r.in_letters, r.dims) == (q.fmt, q.letters, q.in_letters, q.dims)
    for name in ("codes", "scale", "offset"):
      a, b = getattr(q, name), getattr(r, name)
      assert (a is None) == (b is None), (path, name)
      if a is not None:
        assert a.dtype == b.dtype, (path, name)
        np.testing.assert_array_equal(a, b, err_msg=f"{path}.{name}")
  tokens = jnp.asarray([tokenizer.encode(PROMPT)])
  np.testing.assert_array_equal(model(tokens), loaded(tokens))


def test_engine_generates_the_same_tokens_from_the_reloaded_checkpoint(tmp_path, tokenizer):
  model, plan = _quantized("int4-g32")
  save_quantized(model, tokenizer, str(tmp_path / "q"), plan)
  loaded, tok = load_quantized(str(tmp_path / "q"))
  want = _greedy(model, tokenizer)
  assert len(want) == 8 and _greedy(loaded, tok) == want
  # The serving engine (continuous batching over paged KV, also the RL rollout engine) and
  # an int8 KV cache run the quantized checkpoint too.
  from infer.serving import PagedEngine
  prompts = [tok.encode(PROMPT), tok.encode("ROMEO:")]
  params = SamplingParams(max_tokens=8)
  dense = [r.token_ids for r in Engine(loaded, tok, max_seq_len=64).generate(prompts, params)]
  assert dense[0] == want
  paged = PagedEngine(loaded, tok, max_seq_len=64, max_batch=2)
  assert [r.token_ids for r in paged.generate(prompts, params)] == dense
  paged8 = PagedEngine(loaded, tok, max_seq_len=64, max_batch=2, kv_dtype="int8")
  assert [len(r.token_ids) for r in paged8.generate(prompts, params)] == [8, 8]


def test_failed_save_leaves_nothing_behind(tmp_path, tokenizer):
  model, plan = _quantized("int8")
  model.final_norm.scale.set_value(object())  # Orbax cannot write this leaf
  out = tmp_path / "q"
  with pytest.raises(Exception) as failure:
    save_quantized(model, tokenizer, str(out), plan)
  assert "object" in str(failure.value) or "type" in str(failure.value).lower(), failure.value
  assert not out.exists()
  assert os.listdir(tmp_path) == [], "the temporary directory must be removed"


def test_save_refuses_a_plan_that_disagrees_with_the_model(tmp_path, tokenizer):
  model, plan = _quantized("int8")
  with pytest.raises(ValueError, match="embed_VD"):
    save_quantized(model, tokenizer, str(tmp_path / "q"), {**plan, "embed_VD": "int4-g32"})
  with pytest.raises(FileExistsError, match="not an empty directory"):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    save_quantized(model, tokenizer, str(tmp_path / "full"), plan)


def _edit_plan(directory, edit):
  path = os.path.join(directory, "quant.json")
  with open(path) as f:
    info = json.load(f)
  edit(info["plan"])
  with open(path, "w") as f:
    json.dump(info, f)


def test_bad_checkpoints_are_refused_clearly(tmp_path, tokenizer):
  with pytest.raises(FileNotFoundError, match="no quant.json"):
    load_quantized(str(tmp_path))
  model, plan = _quantized("int8")
  out = str(tmp_path / "q")
  save_quantized(model, tokenizer, out, plan)
  _edit_plan(out, lambda p: p.update({"blocks/attn/wz_DNH": "int8"}))
  with pytest.raises(ValueError, match="wz_DNH"):
    load_quantized(out)
  _edit_plan(out, lambda p: (p.pop("blocks/attn/wz_DNH"), p.update({"embed_VD": "int3-g7"})))
  with pytest.raises(ValueError, match="embed_VD.*int3-g7"):
    load_quantized(out)


def test_calibration_ids_from_text_and_json_records(tmp_path, tokenizer):
  ids = calibration_ids(SHAKESPEARE, tokenizer, samples=4, length=16)
  assert ids.shape == (4, 16) and ids.dtype == np.int32
  records = tmp_path / "c.jsonl"
  records.write_text("\n".join(json.dumps(r) for r in [
      {"instruction": "Say hi.", "output": "Hi there, friend."},
      {"text": "Plain text record " * 4}, {"other": 1}]))
  ids = calibration_ids(str(records), tokenizer, samples=100, length=8)
  stream = (tokenizer.encode("Say hi.\nHi there, friend.") + [tokenizer.eos_id]
            + tokenizer.encode("Plain text record " * 4) + [tokenizer.eos_id])
  assert ids.shape == (len(stream) // 8, 8)  # fewer pieces than asked: all there are
  assert ids.reshape(-1).tolist() == stream[:ids.size]
  (tmp_path / "bad.json").write_text(json.dumps([{"other": 1}]))
  with pytest.raises(ValueError, match="'text'"):
    calibration_ids(str(tmp_path / "bad.json"), tokenizer, 4, 8)


def _quantize_fails(tmp_path, workdir, *args, match):
  out = tmp_path / "q"
  with pytest.raises(SystemExit) as info:
    main(["quantize", "--model", workdir, "--out", str(out), *args])
  assert match in str(info.value), str(info.value)
  assert not out.exists()


def test_quantize_refuses_bad_input(tmp_path, workdir):
  _quantize_fails(tmp_path, workdir, "--format", "int3-g64", "--method", "rtn", match="int3-g64")
  for method in ("gptq", "awq", "awq-gptq"):
    _quantize_fails(tmp_path, workdir, "--format", "int4-g128", "--method", method,
                    match="--calib")
  _quantize_fails(tmp_path, workdir, "--format", "int8-a8", "--method", "smooth",
                  match="--calib")
  _quantize_fails(tmp_path, workdir, "--format", "int8", "--method", "smooth",
                  "--calib", SHAKESPEARE, match="use an -a8 format (e.g. int8-a8)")
  # d_model 64: a 128-row group does not fit; the error names a layer and the sizes.
  _quantize_fails(tmp_path, workdir, "--format", "int4-g128", "--method", "rtn",
                  match="group size 128 (int4-g128) does not divide the contraction dimension 64")


def test_quantize_then_generate_end_to_end(tmp_path, workdir):
  out = str(tmp_path / "q")
  args = ["--format", "int4-g128", "--fit_groups", "--embeddings", "int8"]
  run = _meshlm("quantize", "--model", workdir, "--method", "rtn", "--out", out, *args)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "x smaller" in run.stdout and "int4-g64 x6" in run.stdout, run.stdout
  with open(os.path.join(out, "quant.json")) as f:
    info = json.load(f)
  assert info["plan"]["embed_VD"] == "int8" and info["plan"]["blocks/mlp/down_FD"] == "int4-g128"
  # the source as reports write paths (train/report_paths.py): no absolute host path
  assert not os.path.isabs(info["source"]), info["source"]
  assert info["source"].endswith("/" + os.path.basename(os.path.normpath(workdir)))
  run = _meshlm("generate", "--model", out, "--prompt", PROMPT, "--max_new_tokens", "5")
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip()


@pytest.mark.parametrize("fmt,emb", [("int4-g32-zp", "int8"), ("int8-a8", "same")])
def test_meshlm_serve_answers_from_a_quantized_checkpoint(tmp_path, workdir, fmt, emb):
  """`meshlm serve` started on `meshlm quantize`'s output, asked over real HTTP, answers with
  the tokens the engine gives the reloaded checkpoint (W8A8: integer matmuls throughout)."""
  from serve_util import ServeProcess
  out = str(tmp_path / "q")
  main(["quantize", "--model", workdir, "--format", fmt, "--method", "rtn",
        "--embeddings", emb, "--out", out])
  model, tokenizer = load_quantized(out)
  tokens = _greedy(model, tokenizer, n=6)
  assert tokens
  server = ServeProcess(["--model", out, "--max_model_len", "64", "--max_num_seqs", "2",
                         "--max_tokens", "16"], str(tmp_path / "serve.log"))
  try:
    with server.client() as client:
      model_id = client.get("/v1/models").json()["data"][0]["id"]
      reply = client.post("/v1/completions", json={"model": model_id, "prompt": PROMPT,
                                                    "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(tokens)
    assert reply.json()["usage"]["completion_tokens"] == len(tokens)
  finally:
    server.stop()


def test_w8a8_smoothed_checkpoint_quantize_then_generate(tmp_path, workdir):
  """`meshlm quantize --format int8-a8 --method smooth` records an α (or none) per layer and
  pair; `meshlm generate` loads the checkpoint and prints the engine's greedy text."""
  out = str(tmp_path / "q")
  main(["quantize", "--model", workdir, "--format", "int8-a8", "--method", "smooth",
        "--calib", SHAKESPEARE, "--calib_samples", "4", "--calib_len", "32", "--out", out])
  model, tokenizer = load_quantized(out)
  with open(os.path.join(out, "quant.json")) as f:
    info = json.load(f)
  assert info["plan"]["embed_VD"] == "int8" and info["plan"]["blocks/mlp/down_FD"] == "int8-a8"
  alphas = info["calibration"]["smooth_alpha"]
  assert len(alphas) == 4 and all(len(a) == model.cfg.num_layers for a in alphas.values())
  tokens = _greedy(model, tokenizer, n=5)
  run = _meshlm("generate", "--model", out, "--prompt", PROMPT, "--max_new_tokens", "5",
                "--temperature", "0")
  assert run.returncode == 0, run.stderr[-3000:]
  assert tokenizer.decode(tokens) in run.stdout, (tokenizer.decode(tokens), run.stdout)


@pytest.mark.parametrize("method", ["gptq", "awq", "awq-gptq"])
def test_quantize_calibrated(tmp_path, workdir, method):
  out = str(tmp_path / "q")
  main(["quantize", "--model", workdir, "--format", "int4-g32", "--method", method,
        "--calib", SHAKESPEARE, "--calib_samples", "4", "--calib_len", "32", "--out", out])
  model, tokenizer = load_quantized(out)
  with open(os.path.join(out, "quant.json")) as f:
    info = json.load(f)
  assert info["method"] == method and info["calibration"]["samples"] == 4
  if method != "gptq":   # one α per layer for each of the four foldable pairs
    alphas = info["calibration"]["awq_alpha"]
    assert len(alphas) == 4 and all(len(a) == model.cfg.num_layers for a in alphas.values())
  assert len(_greedy(model, tokenizer, n=4)) == 4


def test_quantize_with_scale_tuning(tmp_path, workdir):
  """--tune_epochs trains the scales after round-to-nearest (zero-point INT4 here) and
  records the run; without --calib it is refused before the model loads. The default
  --embeddings auto keeps the embedding and LM head at INT8 under the INT4 format."""
  with pytest.raises(SystemExit, match="--tune_epochs=2 needs calibration text"):
    main(["quantize", "--model", workdir, "--format", "int4-g32-zp", "--method", "rtn",
          "--tune_epochs", "2", "--out", str(tmp_path / "none")])
  out = str(tmp_path / "q")
  main(["quantize", "--model", workdir, "--format", "int4-g32-zp", "--method", "rtn",
        "--calib", SHAKESPEARE, "--calib_samples", "4", "--calib_len", "32",
        "--tune_epochs", "2", "--out", out])
  with open(os.path.join(out, "quant.json")) as f:
    info = json.load(f)
  tune = info["calibration"]["tune"]
  assert (tune["epochs"], tune["batch"]) == (2, 4) and tune["kl_last"] < tune["kl_first"]
  model, tokenizer = load_quantized(out)
  formats = {path: q.fmt.name for path, q in quantized_params(model).items()}
  embeddings = {p: f for p, f in formats.items() if p.endswith(("embed_VD", "unembed_DV"))}
  assert embeddings and set(embeddings.values()) == {"int8"}, formats
  assert {f for p, f in formats.items() if p not in embeddings} == {"int4-g32-zp"}, formats
  assert info["embeddings"] == "auto"
  assert len(_greedy(model, tokenizer, n=4)) == 4


def test_other_format_versions_are_refused(tmp_path, tokenizer):
  import json
  model, plan = _quantized("int8")
  out = str(tmp_path / "q")
  save_quantized(model, tokenizer, out, plan)
  info_path = os.path.join(out, "quant.json")
  with open(info_path) as f:
    info = json.load(f)
  info["version"] = 1
  with open(info_path, "w") as f:
    json.dump(info, f)
  with pytest.raises(ValueError, match="format version 1"):
    load_quantized(out)
