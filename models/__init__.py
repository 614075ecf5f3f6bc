"""The decoder model, written once with logical axis names, and its checkpoint interop."""

from models.config import ConfigError, ModelConfig
from models.tokenizer import Tokenizer
from models.transformer import Block, Transformer, abstract_model
from models.hf_io import export_hf
from models.pretrained import load_pretrained, load_pretrained_tokenizer
