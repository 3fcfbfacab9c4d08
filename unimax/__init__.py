"""UNI MAX: phase-specialized inference for Gated DeltaNet language models."""

from .cache import (
    RecurrentCache,
    cache_payload_bytes,
    copy_cache_,
    restore_cache_,
    snapshot_cache,
)
from .checkpoint import CheckpointError, load_model, load_tokenizer
from .config import GDNConfig
from .model import CausalLMOutput, GDNForCausalLM
from .reference import exact_greedy_tokens

__all__ = [
    "CausalLMOutput",
    "CheckpointError",
    "GDNConfig",
    "GDNForCausalLM",
    "RecurrentCache",
    "cache_payload_bytes",
    "copy_cache_",
    "exact_greedy_tokens",
    "load_model",
    "load_tokenizer",
    "restore_cache_",
    "snapshot_cache",
]
