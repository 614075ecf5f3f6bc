"""The decoder families read from and written to Hugging Face directories: one registry, one
small file per family (its config.json mapping and tensor names). models/hf_io.py reads and
writes the tensors by these names; docs/models.md lists what each family is checked for."""

from models.config import ModelConfig
# Each module registers its family; Llama first, so errors list the families from it.
from models.families import llama  # noqa: F401, I001
from models.families import (deepseek, gemma2, gemma3, mistral, mixtral, olmoe,  # noqa: F401
                             phi3, qwen2, qwen2_moe, qwen3, qwen3_moe)
from models.families.base import FLAT, REGISTRY, Family, PerHead, common_hf, common_values

__all__ = ["FLAT", "REGISTRY", "PerHead", "config_from_hf", "config_to_hf", "family_of",
           "layer_offset", "lookup_name", "name_table"]


# The fields that tell the families apart, named when none (or several) claims a model.
_TELLING = ("num_experts", "qkv_bias", "qk_norm", "qk_norm_full", "sliding_window",
            "mlp_activation", "attention_scale", "shared_mlp_dim", "shared_gate", "layer_pattern",
            "rope_local_theta", "attn_softcap", "final_softcap", "embed_scale", "norm_offset",
            "sandwich_norms", "kv_lora_rank", "router_score", "first_dense_layers")


def _supported() -> str:
  return ", ".join(f"{f.architecture} (model_type {t!r})" for t, f in REGISTRY.items())


def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
  """ModelConfig from a registered family's config.json; what we cannot run exactly is
  rejected, naming the key."""
  arch, model_type = hf.get("architectures") or [], hf.get("model_type")
  family = REGISTRY.get(model_type)
  if family is None or any(a != family.architecture for a in arch):
    raise ValueError(f"unsupported architecture {arch or model_type!r} (model_type={model_type!r})"
                     f" in {source}; only {_supported()}, BERT encoders ('bert', "
                     "models/hf_bert.py) and T5ForConditionalGeneration ('t5', models/hf_t5.py) "
                     "are supported")

  if family.normalize is not None:
    hf = family.normalize(hf, source)

  def get(key):
    return hf.get(key, family.defaults.get(key))

  values = {**common_values(hf, get, source), **family.values(hf, get, source),
            "hf_family": model_type}
  values.update({key: v for key, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def family_of(cfg: ModelConfig) -> Family:
  """The one family a ModelConfig exports as; ValueError naming why none can."""
  if not cfg.llama_shaped or cfg.arch != "decoder" or cfg.position != "rope":
    raise ValueError(
        f"export_hf writes Hugging Face decoder checkpoints; this model (arch={cfg.arch!r}, norm="
        f"{cfg.norm!r}/{cfg.norm_position!r}, mlp_activation={cfg.mlp_activation!r}, position="
        f"{cfg.position!r}, use_bias={cfg.use_bias}, attention_scale={cfg.attention_scale}) would "
        "load as a different model")
  claimed = [f for f in REGISTRY.values() if f.claims(cfg)]
  loaded_as = [f for f in claimed if f.model_type == cfg.hf_family]
  if loaded_as:  # e.g. a Phi-3 is a windowed Llama too (Mistral): it goes back as it came
    return loaded_as[0]
  if len(claimed) != 1:
    raise ValueError(
        "no Hugging Face family here has this combination (" + ", ".join(
            f"model.{k}={getattr(cfg, k)!r}" for k in _TELLING) + "): cannot export"
        if not claimed else
        f"families {[f.model_type for f in claimed]} all claim this model: a registry bug")
  return claimed[0]


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json of the family `cfg` belongs to, readable by transformers 4 (rope_theta) and 5."""
  family = family_of(cfg)
  return family.to_hf(cfg, common_hf(cfg, family))


def name_table(cfg: ModelConfig) -> dict:
  """Our param path -> (HF name template, n_in) for this config's family. A template's "{0}"
  is the layer's index in its stack: `layer_offset` gives the HF index of the first."""
  family = family_of(cfg)
  stacks = [("blocks", cfg)]
  if cfg.first_dense_layers:
    stacks.append(("dense_blocks", cfg.dense_config))
  return {**family.global_names,
          **{(stack, *path): ("model.layers.{0}." + name, n_in)
             for stack, stack_cfg in stacks
             for path, (name, n_in) in family.layer_names(stack_cfg).items()}}


def layer_offset(cfg: ModelConfig, path: tuple) -> int:
  """The HF layer index of the first layer of param `path`'s stack: the MoE stack follows the
  first_dense_layers dense blocks."""
  return cfg.first_dense_layers if path[0] == "blocks" else 0


def lookup_name(table: dict, path: tuple) -> tuple[str, int]:
  """(HF name template, n_in) of param `path` in a `name_table`; ValueError if it has none."""
  if path not in table:  # e.g. MoE extras that config_to_hf rejects first
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face equivalent")
  return table[path]
