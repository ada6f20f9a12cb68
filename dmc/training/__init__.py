"""Retrofitting pipeline: typed configs, phases, the megatron-core training loop, checkpoints."""
from dmc.training.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config"]
