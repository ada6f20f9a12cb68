"""DMCSelfAttention on a CUDA GPU: the FlexAttention backends (the decisions' gradient through
the mask by FlexAttention's atomic adds, by the swapped pass of "flex-transposed", or from the
key gradient in the zeroed decision channel, "flex-channel") equal the
dense bias backend in a train-mode step (Gumbel decisions, CR loss; with and without delayed
merging): the loss and every parameter gradient; so does a step with ``dmc.compile_elementwise``
(gpu mark: skipped without CUDA; the CPU forward comparison is in test_attention.py)."""
import pytest
import torch

from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from tiny_models import VOCAB, spread_decisions, tiny_config

pytestmark = pytest.mark.gpu


def train_step_grads(backend, hard, state, tokens, positions, delay=0, compiled=False):
    """Loss and parameter gradients of one train-mode forward/backward with ``backend``
    (``delay``: ``dmc.merge_delay``; ``compiled``: ``dmc.compile_elementwise``)."""
    runtime = DMCRuntime(DMCConfig(window=4, c=0.0, hard=hard, attention_backend=backend,
                                   merge_delay=delay, compile_elementwise=compiled))
    model = build_gpt_model(tiny_config(2), VOCAB, 256, dmc=runtime)
    model.load_state_dict(state)
    runtime.set_mode("train")
    runtime.target_cr = 2.0
    loss = model(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend,hard,delay,compiled", [
    ("flex", False, 0, False), ("flex", True, 0, False), ("flex", False, 16, False),
    ("flex-transposed", True, 0, False), ("flex-transposed", False, 16, False),
    ("flex-channel", True, 0, False), ("flex-channel", False, 0, False),
    ("flex-channel", True, 16, False), ("flex-channel", False, 0, True),
    ("flex-channel", True, 16, True)])
def test_flex_train_step_matches_dense(parallel_1x1, backend, hard, delay, compiled):
    torch.manual_seed(0)
    reference = build_gpt_model(tiny_config(2), VOCAB, 256, dmc=DMCRuntime(DMCConfig()))
    spread_decisions(reference, scale=1.0)
    state = reference.state_dict()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 200), generator=gen).cuda()
    positions = torch.arange(200, device="cuda").expand(2, 200)
    dense_loss, dense = train_step_grads("dense", hard, state, tokens, positions, delay)
    flex_loss, flex = train_step_grads(backend, hard, state, tokens, positions, delay, compiled)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)
    assert flex.keys() == dense.keys() and any("linear_qkv" in n for n in dense)
    for name, grad in dense.items():
        error = float((flex[name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert error < 2e-3, name
