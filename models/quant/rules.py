"""Which weights get which format: rules over parameter paths, applied to a built model.

A rule is (regex, format name or None). Each quantizable parameter takes the
first rule whose regex matches (`re.search`) its path, e.g.
'blocks/attn/wq_DNH' or 'embed_VD'; None keeps it in float. Parameters no rule
matches stay float. Norm scales, MoE experts and routers are never quantized.

    rules = [("embed_VD|unembed_DV", "int8"), (".*", "int4-g128")]
    plan = quant_plan(model, rules)          # {path: QuantFormat}
    quantize_model(model, rules)             # round-to-nearest, in place

The contraction letters of each parameter (the axes its einsum sums over) are
fixed by the model code and listed in CONTRACTS.
"""

import dataclasses
import math
import re

from flax import nnx

from models.quant.formats import QuantFormat, check_group, parse_format
from models.quant.qarray import QArray

# parameter name -> its contraction letters (the tied embedding contracts D when it unembeds).
CONTRACTS = {
    "wq_DNH": "D", "wk_DKH": "D", "wv_DKH": "D", "wo_NHD": "NH",
    "gate_DF": "D", "up_DF": "D", "down_FD": "F",
    "embed_VD": "D", "unembed_DV": "D",
    # latent attention (models/mla.py); its per-head wk_b_CNH and wv_b_CNU stay float
    "wq_DNX": "D", "wq_a_DQ": "D", "wq_b_QNX": "Q", "wkv_a_DC": "D", "wkr_DR": "D",
    "wo_NUD": "NU",
}


def default_rules(fmt: str, embeddings: str | None = "same") -> list[tuple[str, str | None]]:
  """Every projection in `fmt`; embeddings/LM head in `fmt` ('same'), another format, None
  (float), or 'auto': weight-only int8 under an INT4 or -a8 `fmt`, else `fmt`."""
  if embeddings == "auto":
    # At INT4 the tied SmolLM2 embedding costs more perplexity than all the projections
    # together (docs/results.md, "Quantization": INT4-g128 RTN with it, +58.9%). Under -a8,
    # smoothing cannot fold into a tied LM head, and its per-token int8 activations cost
    # SmolLM2 about 0.7 points of perplexity for no speed in a side check.
    embeddings = "int8" if fmt.startswith("int4") or fmt.endswith("-a8") else "same"
  emb = fmt if embeddings == "same" else embeddings
  return [("(^|/)(embed_VD|unembed_DV)$", emb), (".*", fmt)]


def letters_of(path: str) -> str:
  return path.rsplit("/", 1)[-1].rsplit("_", 1)[-1]


def axes_of(path: str) -> tuple[str, str]:
  """(the parameter's letters, its contraction letters), e.g. ('NHD', 'NH')."""
  return letters_of(path), CONTRACTS[path.rsplit("/", 1)[-1]]


def contraction_size(path: str, shape) -> int:
  """K of a parameter of `shape` (any leading stacked axes ignored)."""
  letters, in_letters = axes_of(path)
  dims = tuple(shape)[len(shape) - len(letters):]
  return math.prod(int(dims[letters.index(c)]) for c in in_letters)


def params_by_path(model) -> dict[str, nnx.Variable]:
  """{path: the model's own Param variable}, for replacing values in place."""
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {"/".join(str(k) for k in path): var for path, var in flat}


def fit_group(fmt: QuantFormat, k: int) -> QuantFormat:
  """`fmt`, or the same format with the largest halving of its group that divides k."""
  g = fmt.group_for(k)
  while fmt.group and k % g and (g // 2) % 2 == 0 and g > 8:   # groups stay even
    g //= 2
  return fmt if g == fmt.group_for(k) else dataclasses.replace(fmt, group=g)


def quant_plan(model, rules, *, fit_groups: bool = False) -> dict[str, QuantFormat]:
  """{parameter path: format} for the parameters the rules quantize.

  A group that does not divide a parameter's contraction is refused, naming
  the parameter and the sizes, unless `fit_groups` halves it until it does
  (reported in the plan, e.g. int4-g128 becomes int4-g64 on a 576-wide input).
  """
  params = params_by_path(model)
  compiled = []
  for pattern, fmt in rules:
    compiled.append((re.compile(pattern), None if fmt is None else parse_format(fmt)))
  plan, used = {}, set()
  for path, var in params.items():
    if path.rsplit("/", 1)[-1] not in CONTRACTS:
      continue  # norms, MoE experts and routers stay in float
    for i, (regex, fmt) in enumerate(compiled):
      if regex.search(path):
        used.add(i)
        if fmt is not None:
          if isinstance(var[...], QArray):
            raise ValueError(f"{path} is already quantized ({var[...].fmt.name}); quantize "
                             "the float model instead")
          k = contraction_size(path, var.shape)
          if fit_groups:
            fmt = fit_group(fmt, k)
          check_group(fmt, k, f"{path} (shape {tuple(var.shape)})")
          plan[path] = fmt
        break
  unused = [rules[i][0] for i in range(len(rules)) if i not in used]
  if unused:
    raise ValueError(f"quantization rule(s) {unused} match no quantizable parameter of the model "
                     f"(quantizable: {', '.join(CONTRACTS)}; norms and MoE experts stay float)")
  return plan

