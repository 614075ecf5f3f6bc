"""Quantized weights: formats, the QArray weight type and the quantization rules."""

from models.quant.formats import QuantFormat, parse_format
from models.quant.qarray import QArray
from models.quant.rules import default_rules, quant_plan

__all__ = ["QArray", "QuantFormat", "default_rules", "parse_format", "quant_plan"]
