"""SDPACoreAttention equals megatron's DotProductAttention (MHA and GQA, forward and backward)."""
import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from dmc.megatron.core_attention import SDPACoreAttention
from dmc.megatron.model import llama_transformer_config


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_sdpa_matches_megatron(parallel_1x1, groups):
    config = llama_transformer_config(num_layers=1, hidden_size=64, num_attention_heads=4,
                                      ffn_hidden_size=128, num_query_groups=groups,
                                      params_dtype=torch.float64)
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self")
    torch.manual_seed(0)
    seq, batch = 37, 3
    query = torch.randn(seq, batch, 4, 16, dtype=torch.float64, requires_grad=True)
    key = torch.randn(seq, batch, groups, 16, dtype=torch.float64, requires_grad=True)
    value = torch.randn(seq, batch, groups, 16, dtype=torch.float64, requires_grad=True)
    outputs, grads = [], []
    for cls in (DotProductAttention, SDPACoreAttention):
        out = cls(**kwargs)(query, key, value, None)
        out.pow(2).sum().backward()
        outputs.append(out.detach())
        grads.append([t.grad.clone() for t in (query, key, value)])
        for t in (query, key, value):
            t.grad = None
    assert outputs[1].shape == (seq, batch, 64)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-10)
    for mine, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_fewer_queries_than_keys_take_megatrons_path(parallel_1x1):
    """Queries of the last 2 of 6 positions: SDPA's causal mask would align them with keys 0-1;
    the class hands the case to megatron, which refuses it (as it did before SDPA)."""
    config = llama_transformer_config(num_layers=1, hidden_size=64, num_attention_heads=4,
                                      ffn_hidden_size=128, params_dtype=torch.float64)
    attention = SDPACoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self")
    query = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    key, value = (torch.randn(6, 1, 4, 16, dtype=torch.float64) for _ in range(2))
    with pytest.raises(AssertionError, match="causal mask is only for self attention"):
        attention(query, key, value, None)
