"""Hugging Face Mixtral interop: random transformers Mixtrals load with equal logits and export."""

import dataclasses
import json

import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import models  # noqa: E402
from models import hf_io  # noqa: E402
from test_hf_parity import TOL, _max_diff, _tokens, _torch_logits, _write_tokenizer  # noqa: E402

CASES = {
    # Top-1 routing (the renormalised weight is exactly 1), multi-head attention.
    "e4_top1_mha": dict(experts=4, k=1, heads=4, kv=4),
    # Mixtral's own 2-of-8, untied, head_dim != d_model / heads, rope base 1e4.
    "e8_top2_wide_heads": dict(experts=8, k=2, heads=4, kv=4, head_dim=16, theta=10000.0),
    # 2-of-4 with GQA, tied embeddings and three layers.
    "e4_top2_gqa_tied": dict(experts=4, k=2, heads=4, kv=2, layers=3, tied=True),
}
LEGACY_W1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


def make_mixtral_checkpoint(directory, vocab=101, hidden=32, inter=48, layers=2, heads=4, kv=2,
                            head_dim=None, experts=4, k=2, tied=False, theta=None, seed=0,
                            **save_kwargs):
  """A random float32 MixtralForCausalLM saved with `save_pretrained`, plus a tokenizer."""
  rope = {} if theta is None else {"rope_theta": theta}  # None: Mixtral's default 1e6
  config = transformers.MixtralConfig(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
      num_local_experts=experts, num_experts_per_tok=k, tie_word_embeddings=tied,
      max_position_embeddings=128, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2,
      # Large weights spread the router logits, so a swapped expert or a wrong
      # router normalisation moves the logits by much more than TOL.
      initializer_range=0.2, **rope)
  torch.manual_seed(seed)
  model = transformers.MixtralForCausalLM(config).eval()
  norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
  with torch.no_grad():  # non-trivial norm scales
    for p in norms:
      p.copy_(1.0 + 0.3 * torch.randn_like(p))
  model.save_pretrained(directory, **save_kwargs)
  _write_tokenizer(directory, vocab)
  return model


def _tensor_names(directory):
  with safe_open(str(directory / hf_io.WEIGHTS_FILE), framework="np") as f:
    return set(f.keys())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
  spec = CASES[case]
  hf_model = make_mixtral_checkpoint(tmp_path, **spec)
  assert LEGACY_W1 in _tensor_names(tmp_path)  # transformers 5 saves the Hub's per-expert names
  model, _ = models.load_pretrained(str(tmp_path))
  cfg = model.cfg
  assert (cfg.num_experts, cfg.top_k, cfg.mlp_dim, cfg.num_kv_heads) == (
      spec["experts"], spec["k"], 48, spec["kv"])
  assert (cfg.router_norm, cfg.moe_impl, cfg.shared_mlp_dim) == ("topk", "dropless", 0)
  assert cfg.rope_theta == spec.get("theta", 1e6)
  assert cfg.aux_loss_weight == pytest.approx(0.02 * spec["k"])
  tokens_BT = _tokens(101)
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model, tokens_BT)) <= TOL


def test_fused_expert_layout_loads(tmp_path):
  """transformers 5's in-memory layout (gate_up_proj [E, 2F, D]), as save_original_format=False
  writes it, loads like the per-expert one."""
  hf_model = make_mixtral_checkpoint(tmp_path, experts=4, k=2, save_original_format=False)
  names = _tensor_names(tmp_path)
  assert "model.layers.1.mlp.experts.gate_up_proj" in names and LEGACY_W1 not in names
  model, _ = models.load_pretrained(str(tmp_path))
  tokens_BT = _tokens(101, seed=2)
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model, tokens_BT)) <= TOL


@pytest.mark.parametrize("case", ["e4_top1_mha", "e4_top2_gqa_tied"])
def test_export_round_trip(tmp_path, case):
  spec = CASES[case]
  make_mixtral_checkpoint(tmp_path / "src", **spec)
  model, tok = models.load_pretrained(str(tmp_path / "src"))
  out = tmp_path / "exported"
  models.export_hf(model, tok, str(out))
  assert LEGACY_W1 in _tensor_names(out)
  with open(out / hf_io.CONFIG_FILE) as f:
    assert json.load(f)["router_aux_loss_coef"] == pytest.approx(0.02)

  tokens_BT = _tokens(101, seed=1)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  assert type(hf_model).__name__ == "MixtralForCausalLM"
  assert hf_model.config.num_experts_per_tok == spec["k"]
  assert _max_diff(model, tokens_BT, _torch_logits(hf_model.eval(), tokens_BT)) <= TOL
  again, _ = models.load_pretrained(str(out))  # and our own loader reads it back bit for bit
  with jax.default_matmul_precision("highest"):
    reference_BTV = np.asarray(model(jnp.asarray(tokens_BT)))
  assert _max_diff(again, tokens_BT, reference_BTV) == 0.0


@pytest.mark.parametrize("change", [
    dict(shared_mlp_dim=16), dict(router_bias_rate=1e-3), dict(router_norm="all"),
    dict(sliding_window=5)])
def test_export_rejects_what_mixtral_cannot_express(tmp_path, change):
  cfg = dataclasses.replace(models.ModelConfig(num_experts=4, top_k=2, vocab_size=64, d_model=32,
                                               mlp_dim=48, num_layers=1), **change)
  (field, value), = change.items()
  with pytest.raises(ValueError, match=f"model.{field}={value!r}"):
    models.export_hf(models.abstract_model(cfg), None, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_config_defaults_match_transformers():
  """Keys a Mixtral config.json omits get transformers' defaults, not Llama's."""
  minimal = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=8)
  cfg = hf_io.config_from_hf({"model_type": "mixtral", **minimal})
  ref = transformers.MixtralConfig(**minimal)
  assert (cfg.num_kv_heads, cfg.num_experts, cfg.top_k, cfg.norm_eps, cfg.max_seq_len) == (
      ref.num_key_value_heads, ref.num_local_experts, ref.num_experts_per_tok, ref.rms_norm_eps,
      ref.max_position_embeddings)
  assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
  assert ref.sliding_window is None  # so a default Mixtral is accepted


@pytest.mark.parametrize("change, message", [
    (dict(sliding_window=16), "sliding_window=16"),
    (dict(architectures=["LlamaForCausalLM"]), r"\[.LlamaForCausalLM.\] \(model_type=.mixtral.\)"),
    (dict(num_experts_per_tok=5), "top_k=5"),
])
def test_unsupported_config_is_rejected(tmp_path, change, message):
  make_mixtral_checkpoint(tmp_path, layers=1)
  with open(tmp_path / hf_io.CONFIG_FILE) as f:
    config = json.load(f)
  with open(tmp_path / hf_io.CONFIG_FILE, "w") as f:
    json.dump({**config, **change}, f)
  with pytest.raises(ValueError, match=message):
    models.load_pretrained(str(tmp_path))


def test_missing_or_extra_expert_is_named(tmp_path):
  make_mixtral_checkpoint(tmp_path, layers=1, experts=4)
  path = tmp_path / hf_io.WEIGHTS_FILE
  tensors = load_file(path)
  w2 = tensors.pop("model.layers.0.block_sparse_moe.experts.3.w2.weight")
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing tensor .*experts\.3\.w2\.weight"):
    models.load_pretrained(str(tmp_path))
  tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"] = w2
  tensors["model.layers.0.block_sparse_moe.experts.4.w2.weight"] = w2
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"does not use.*experts\.4\.w2\.weight"):
    models.load_pretrained(str(tmp_path))
