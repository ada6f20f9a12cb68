"""Inference with a compressed cache: paged per-head KV cache and its kernels (Algorithm 1)."""
from .cache import CacheFullError, PagedKVCache

__all__ = ["CacheFullError", "PagedKVCache"]
