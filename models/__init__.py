"""The models, written once with logical axis names, and their checkpoint interop."""

from models.config import ConfigError, ModelConfig
from models.tokenizer import Tokenizer
from models.transformer import Block, Transformer
from models.encoder import Encoder
from models.encoder_decoder import EncoderDecoder
from models.registry import abstract_model, create_model, model_inputs, param_count
from models.hf_io import export_hf
from models.pretrained import load_pretrained, load_pretrained_tokenizer
