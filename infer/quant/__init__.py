"""Weight-only quantization: formats, QArray weights, rules, RTN and GPTQ calibration."""

from models.quant.formats import QuantFormat, parse_format
from models.quant.qarray import QArray
from infer.quant.quantize import quantize_model, weight_bytes
from models.quant.rules import default_rules, quant_plan

__all__ = ["QArray", "QuantFormat", "default_rules", "parse_format", "quant_plan",
           "quantize_model", "weight_bytes"]
