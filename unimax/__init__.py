"""UNI MAX: phase-specialized inference for Gated DeltaNet language models."""

from .build import build_engine
from .cache import (
    RecurrentCache,
    cache_payload_bytes,
    copy_cache_,
    restore_cache_,
    snapshot_cache,
)
from .checkpoint import CheckpointError, load_model, load_tokenizer
from .config import GDNConfig
from .engine import BridgeReport, Generation, UniMaxEngine, VerifyReport
from .fp8 import FP8Linear, quantize_view
from .graph import MaxTurboGraphDecoder
from .kernels import KernelConfig
from .model import CausalLMOutput, GDNForCausalLM
from .reference import exact_greedy_tokens
from .sampling import SamplingParams

__all__ = [
    "BridgeReport",
    "FP8Linear",
    "Generation",
    "MaxTurboGraphDecoder",
    "SamplingParams",
    "UniMaxEngine",
    "VerifyReport",
    "build_engine",
    "quantize_view",
    "CausalLMOutput",
    "CheckpointError",
    "GDNConfig",
    "GDNForCausalLM",
    "KernelConfig",
    "RecurrentCache",
    "cache_payload_bytes",
    "copy_cache_",
    "exact_greedy_tokens",
    "load_model",
    "load_tokenizer",
    "restore_cache_",
    "snapshot_cache",
]
