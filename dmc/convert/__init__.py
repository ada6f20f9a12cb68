"""Checkpoint conversion: Hugging Face <-> megatron-core, DMC and DMS export to transformers,
NVIDIA's released DMC checkpoints (Megatron-LM legacy format) and DMS checkpoints (Hugging Face,
Model-Optimizer ``experimental/dms``) -> ours."""
from dmc.convert.from_hf import hf_to_mcore
from dmc.convert.hf_config import UnsupportedModelError
from dmc.convert.nvidia import nvidia_dmc_to_mcore
from dmc.convert.nvidia_dms import nvidia_dms_to_mcore
from dmc.convert.to_hf import mcore_to_hf

__all__ = ["hf_to_mcore", "mcore_to_hf", "nvidia_dmc_to_mcore", "nvidia_dms_to_mcore",
           "UnsupportedModelError"]
