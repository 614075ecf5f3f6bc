"""Multi-head latent attention and DeepSeek routing (models/mla.py, models/moe.py): the cache
holds the latent only, every cache path generates transformers' tokens, and the routers choose
and weigh experts as transformers' DeepSeek-V3 and V2 routers do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deps

torch = deps.require("torch")
transformers = deps.require("transformers")

from benchmarks.family_parity import FAMILIES, VOCAB, make_family  # noqa: E402
from infer import Engine, SamplingParams, kv_cache, paged  # noqa: E402
from models import ModelConfig, moe  # noqa: E402
from models.config import ConfigError  # noqa: E402

MLA = dict(vocab_size=64, d_model=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16,
           mlp_dim=32, kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, v_head_dim=12,
           rope_interleaved=True, num_experts=8, top_k=2, shared_mlp_dim=32,
           first_dense_layers=1, dense_mlp_dim=96)


def test_the_cache_holds_a_quarter_of_the_full_head_bytes_or_less():
  cfg = ModelConfig(**MLA)
  cache = kv_cache.init(cfg, 2, 64)
  latent = cache.k_LBSKH.nbytes + cache.v_LBSKH.nbytes
  n, h, r, u = cfg.num_heads, cfg.head_dim, cfg.rope_head_dim, cfg.value_dim
  full = cfg.num_layers * 2 * 64 * n * (h + r + u) * 4  # every head's key and value, float32
  assert latent * 4 <= full
  assert latent == kv_cache.cache_bytes(cfg, 2, 64) == cfg.num_layers * 2 * 64 * (16 + 8) * 4
  pool = paged.init_pool(cfg, 9, 4)
  assert pool.k_LKWZH.nbytes + pool.v_LKWZH.nbytes == 9 * paged.page_bytes(cfg, 4)
  assert paged.page_bytes(cfg, 4) * 4 <= cfg.num_layers * 4 * n * (h + r + u) * 4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  return make_family("deepseek_v3", str(tmp_path_factory.mktemp("deepseek_v3")))


def _hf_greedy(hf, prompt, new):
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("unroll", [False, True])
def test_a_batch_of_rows_generates_transformers_tokens(deepseek, unroll):
  """Three prompts of different lengths in one batch, through the scanned stacks (the dense
  block's cache layers split from the experts') and the unrolled layers."""
  hf, ours, tokenizer = deepseek
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, VOCAB, size=(n,)).tolist() for n in (5, 19, 12)]
  engine = Engine(ours, tokenizer, 48, 3, unroll_layers=unroll)
  with jax.default_matmul_precision("highest"):
    got = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
  assert [g.token_ids for g in got] == [_hf_greedy(hf, p, 16) for p in prompts]


def test_an_int8_latent_cache_generates_the_float_caches_first_tokens(deepseek):
  """The int8 cache quantizes the latent and rotary key per token (one scale over C + R)."""
  _, ours, tokenizer = deepseek
  prompt = np.random.default_rng(4).integers(3, VOCAB, size=(24,)).tolist()
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  with jax.default_matmul_precision("highest"):
    (flt,) = Engine(ours, tokenizer, 40, 1).generate([prompt], params)
    (int8,) = Engine(ours, tokenizer, 40, 1, kv_dtype="int8").generate([prompt], params)
  assert int8.token_ids[:4] == flt.token_ids[:4]
  cache = kv_cache.init(ours.cfg, 1, 40, "int8")
  assert cache.k_LBSKH.dtype == jnp.int8 and cache.k_LBSKH.shape[3:] == (1, 16 + 8)
  assert cache.v_LBSKH.size == 0


@pytest.mark.parametrize("version", ["v3", "v2_grouped", "v2_greedy"])
def test_the_router_chooses_and_weighs_as_transformers(version):
  e, k, d, t = 16, 4, 32, 64
  if version == "v3":
    cfg = transformers.DeepseekV3Config(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k,
                                        n_group=4, topk_group=2, norm_topk_prob=True,
                                        routed_scaling_factor=2.5)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
  else:
    grouped = version == "v2_grouped"
    cfg = transformers.DeepseekV2Config(
        hidden_size=d, n_routed_experts=e, num_experts_per_tok=k, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy" if grouped else "greedy",
        n_group=4 if grouped else None, topk_group=2 if grouped else None)
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(cfg)
  torch.manual_seed(0)
  with torch.no_grad():
    router.weight.copy_(torch.randn(e, d))
    bias = None
    if version == "v3":
      router.e_score_correction_bias.copy_(0.1 * torch.randn(e))
      bias = jnp.asarray(router.e_score_correction_bias.numpy())
    x = torch.randn(t, d)
    logits_TE, want_w, want_i = router(x)
  logits = jnp.asarray(logits_TE.numpy())[None]  # the router's own float32 logits
  groups = 4 if version != "v2_greedy" else 0
  expert, weight, _ = moe.route(
      logits, bias, k, "topk" if version == "v3" else "all",
      "sigmoid" if version == "v3" else "softmax", groups, 2 if groups else 0,
      2.5 if version == "v3" else 1.5)
  order = np.argsort(want_i.numpy(), axis=-1)
  want_i = np.take_along_axis(want_i.numpy(), order, -1)
  want_w = np.take_along_axis(want_w.numpy(), order, -1)
  got_order = np.argsort(np.asarray(expert[0]), axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(expert[0]), got_order, -1), want_i)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(weight[0]), got_order, -1), want_w,
                             rtol=1e-5, atol=1e-6)
  if groups:  # the grouping changed some choices: the test sees it
    plain, _, _ = moe.route(logits, bias, k, "all", "sigmoid" if version == "v3" else "softmax")
    assert not np.array_equal(np.sort(np.asarray(plain[0]), -1), want_i)


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=2), "num_kv_heads=2 must equal num_heads"),
    (dict(rope_head_dim=0), "even model.rope_head_dim > 0"),
    (dict(qkv_bias=True), "without ['qkv_bias']"),
    (dict(kv_lora_rank=0), "q_lora_rank=24 is a multi-head latent attention setting"),
    (dict(first_dense_layers=3), "first_dense_layers=3 must be an integer in [0, num_layers=3)"),
    (dict(router_groups=3, router_group_topk=1), "router_groups=3"),
    (dict(router_score="relu"), "router_score='relu'"),
])
def test_bad_latent_and_routing_settings_are_named(change, message):
  with pytest.raises(ConfigError) as e:
    ModelConfig(**{**MLA, **change})
  assert message in str(e.value)


def test_moe_settings_on_a_dense_model_are_refused():
  with pytest.raises(ConfigError, match="first_dense_layers=1 is a mixture-of-experts setting"):
    ModelConfig(**{**MLA, "num_experts": 0})


def test_the_family_table_lists_both_versions():
  assert {"deepseek_v3", "deepseek_v2"} <= set(FAMILIES)


@pytest.mark.parametrize("change", [{}, dict(q_lora_rank=0), dict(
    num_experts=0, first_dense_layers=0, dense_mlp_dim=0, shared_mlp_dim=0)])
def test_closed_form_counts_match_the_model(change):
  """num_params and the FLOP count's attention weights against the built model's arrays."""
  import math

  from flax import nnx

  from models import param_count
  from models.registry import abstract_model
  from train.flops import train_flops_per_token
  cfg = ModelConfig(**{**MLA, **change})
  assert cfg.num_params() == param_count(cfg)
  attn = nnx.state(abstract_model(cfg).blocks.attn, nnx.Param)
  weights = sum(math.prod(x.shape[1:]) for p, x in nnx.to_flat_state(attn)
                if "norm" not in str(p))
  per_token = train_flops_per_token(cfg, 1) / 3  # forward, one position (attention ~ 0)
  dense = ModelConfig(**{**MLA, **change, "kv_lora_rank": 0, "q_lora_rank": 0,
                         "rope_head_dim": 0, "v_head_dim": 0, "rope_interleaved": False})
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  gqa_weights = 2 * d * n * h + 2 * d * cfg.num_kv_heads * h
  gqa_attention = 2 * 2 * n * h * 1 / 2 * cfg.num_layers
  mla_attention = 2 * n * (h + cfg.rope_head_dim + cfg.value_dim) / 2 * cfg.num_layers
  assert (per_token - mla_attention - 2 * cfg.num_layers * weights
          == pytest.approx(train_flops_per_token(dense, 1) / 3 - gqa_attention
                           - 2 * cfg.num_layers * gqa_weights))


def test_a_yarn_mscale_all_dim_export_reads_back_the_same():
  """DeepSeek's YaRN with mscale_all_dim alone: the softmax scale and the derived cos/sin
  factor survive export (transformers derives that factor from `factor`, as we do)."""
  from models.families import config_from_hf, config_to_hf
  hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "max_position_embeddings": 640,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                            "original_max_position_embeddings": 16, "mscale_all_dim": 1.0}}
  cfg = config_from_hf(hf)
  back = config_from_hf(config_to_hf(cfg))
  assert back.rope_attention_factor == cfg.rope_attention_factor == 0.0  # derived: 1.369
  assert back.attention_scale == pytest.approx(cfg.attention_scale, rel=1e-12)
  assert cfg.attention_scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(40.0) + 1) ** 2)
