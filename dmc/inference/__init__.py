"""Inference with a compressed cache: paged per-head KV cache and its kernels (Algorithm 1),
the generation engine and sampling."""
from .cache import CacheFullError, PagedKVCache
from .engine import (
    CompressionStats,
    Engine,
    GenerationResult,
    ScoreResult,
    build_model_from_config,
    load_inference_state,
    save_inference_state,
)
from .sampling import SamplingParams

__all__ = [
    "CacheFullError",
    "CompressionStats",
    "Engine",
    "GenerationResult",
    "PagedKVCache",
    "SamplingParams",
    "ScoreResult",
    "build_model_from_config",
    "load_inference_state",
    "save_inference_state",
]
