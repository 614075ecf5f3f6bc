"""Inference: the KV-cached engine, sampling, and a cache-free reference decoder."""

from infer.engine import Engine
from infer.requests import Result, Token
from infer.sampling import SamplingParams, generate
