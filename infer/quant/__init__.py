"""Quantization of a built model: round-to-nearest (quantize.py), GPTQ and AWQ calibration
(gptq.py, awq.py), SmoothQuant-style int8 activations (smooth.py), per-layer format search
(tune.py), quantized checkpoints (checkpoint.py) and conversion (convert.py); the formats,
QArray weights and rules they share live in models/quant/."""

from models.quant.formats import QuantFormat, parse_format
from models.quant.qarray import QArray
from infer.quant.quantize import quantize_model, weight_bytes
from models.quant.rules import default_rules, quant_plan

__all__ = ["QArray", "QuantFormat", "default_rules", "parse_format", "quant_plan",
           "quantize_model", "weight_bytes"]
