"""dmc.megatron.model: the dtype of what build_gpt_model makes."""
import pytest
import torch

from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_parameter_in_params_dtype_and_the_counters_in_float64(parallel_1x1, dtype):
    """megatron's bf16 optimizer maps its states to the model's parameters by their position
    among the bf16 ones: a float32 norm weight left in a bf16 model broke every checkpoint on a
    GPU. The compression counters stay float64."""
    config = llama_transformer_config(2, 64, 4, 128, params_dtype=dtype)
    model = build_gpt_model(config, 128, 32, dmc=DMCRuntime(DMCConfig()))
    assert {p.dtype for p in model.parameters()} == {dtype}
    names = [n for n, _ in model.named_parameters()]
    assert any("layernorm" in n for n in names)
    counters = {b.dtype for n, b in model.named_buffers() if ".cr_" in n}
    assert counters == {torch.float64}
