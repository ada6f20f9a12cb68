"""Baselines the DMC paper compares against that need their own model (Table 1): GQA."""
from dmc.baselines.gqa import convert_state_dict, convert_to_gqa, pool_qkv

__all__ = ["convert_state_dict", "convert_to_gqa", "pool_qkv"]
