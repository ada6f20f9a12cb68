"""Dynamic Memory Compression for megatron-core."""

__version__ = "0.1.0"
