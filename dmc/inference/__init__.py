"""Inference with a compressed cache: paged per-head KV cache and its kernels (Algorithm 1),
the scheduler, the model runner and the generation engine, sampling and model loading."""
from .block_allocator import CacheFullError
from .cache import PagedKVCache
from .engine import Engine
from .loading import build_model_from_config, load_inference_state, save_inference_state
from .sampling import SamplingParams
from .sequence import CompressionStats, GenerationResult, ScoreResult

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
