"""FlexAttention (compiled for CUDA; "flex", "flex-transposed", which computes the decision
logits' gradient by a swapped forward, and "flex-channel", which reads it from the key gradient
in the keys' zero last channel) with the DMC score_mod against the dense additive-bias path:
outputs and the gradients of queries, keys, values and the decision logits (the CR loss trains
the decisions through the mask), fp32 and bf16, GQA (gpu mark: skipped without CUDA; the eager
CPU version is in test_mask.py)."""
import pytest
import torch

from dmc.ops import dmc_attention, log_keep_next_from_logits

pytestmark = pytest.mark.gpu

RELATIVE_ERROR = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def forward_backward(backend, q, k, v, logits, grad_out):
    """Output and the gradients of ``q, k, v, logits`` through ``dmc_attention``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, logits)]
    out = dmc_attention(*leaves[:3], log_keep_next_from_logits(leaves[3]), backend=backend,
                        zero_key_channel=backend == "flex-channel")
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


SHAPES = [(4, 4, 256), (8, 2, 384), (6, 1, 200), (4, 2, 1100)]  # q_heads, kv_heads, seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,q_heads,kv_heads,seq",
                         [("flex", *shape) for shape in SHAPES]
                         + [("flex-transposed", *shape) for shape in SHAPES[1::2]]
                         + [("flex-channel", *shape) for shape in SHAPES])
def test_flex_forward_and_backward_match_dense(dtype, backend, q_heads, kv_heads, seq):
    gen = torch.Generator().manual_seed(q_heads * 10 + seq)
    batch, dim = 2, 64

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", dtype)

    q, k, v = draw(batch, q_heads, seq, dim), draw(batch, kv_heads, seq, dim), \
        draw(batch, kv_heads, seq, dim)
    k[..., -1] = 0  # DMC's keys after RoPE (flex-channel's premise; the same for the others)
    logits = draw(batch, kv_heads, seq, scale=4.0).float()  # soft decisions, some near 0 or 1
    grad_out = draw(batch, q_heads, seq, dim)
    flex = forward_backward(backend, q, k, v, logits, grad_out)
    dense = forward_backward("dense", q, k, v, logits, grad_out)
    for name, got, want in zip(("output", "dq", "dk", "dv", "dlogits"), flex, dense):
        assert got.dtype == want.dtype and torch.isfinite(got).all(), name
        if name == "dk" and backend == "flex-channel":  # that channel gets no gradient there
            assert not got[..., -1].any()
            got, want = got[..., :-1], want[..., :-1]
        assert relative_error(got, want) < RELATIVE_ERROR[dtype], name
