"""Inference with a compressed cache: paged per-head KV cache and its kernels (Algorithm 1),
DMS's window-ring cache, the scheduler, the model runner and the generation engine, sampling
and model loading."""
from .block_allocator import CacheFullError
from .cache import PagedKVCache
from .dms_cache import DMSPagedCache
from .engine import Engine
from .generation import TokenDelta
from .loading import load_inference_state, save_inference_state
from .sampling import SamplingParams
from .sequence import CompressionStats, GenerationResult, ScoreResult

__all__ = [
    "CacheFullError",
    "CompressionStats",
    "DMSPagedCache",
    "Engine",
    "GenerationResult",
    "PagedKVCache",
    "SamplingParams",
    "ScoreResult",
    "TokenDelta",
    "build_model_from_config",
    "load_inference_state",
    "save_inference_state",
]


def __getattr__(name):
    """``build_model_from_config`` (:mod:`dmc.megatron.model`) imported on first use, so that
    importing ``dmc.inference`` does not import megatron-core."""
    if name == "build_model_from_config":
        from dmc.megatron.model import build_model_from_config

        return build_model_from_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
