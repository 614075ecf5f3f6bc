"""The decoder model, written once with logical axis names, and its checkpoint interop."""

from models.config import ConfigError, ModelConfig
from models.tokenizer import Tokenizer
from models.transformer import Block, Transformer
