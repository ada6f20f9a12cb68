"""DMSSelfAttention on a CUDA GPU: the FlexAttention backends ("flex" and "flex-transposed";
delayed-eviction score_mod, no L x L bias) equal the dense bias backend in a train-mode step
(Gumbel decisions, CR loss): the loss and every parameter gradient (gpu mark: skipped without
CUDA; the CPU forward comparison is in test_dms_attention.py)."""
import pytest
import torch

from dmc.megatron.attention import decision_rows, dmc_layers
from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from tiny_models import VOCAB, tiny_config

pytestmark = pytest.mark.gpu
SETTINGS = dict(method="dms", dms_window=16, c=0.0, dms_logit_scale=10.0, tau=1.0)


def train_step_grads(backend, hard, state, tokens, positions):
    """Loss and parameter gradients of one train-mode forward/backward with ``backend``."""
    runtime = DMCRuntime(DMCConfig(**SETTINGS, hard=hard, attention_backend=backend))
    model = build_gpt_model(tiny_config(2), VOCAB, 256, dmc=runtime)
    model.load_state_dict(state)
    runtime.set_mode("train")
    runtime.target_cr = 2.0
    loss = model(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend,hard", [("flex", False), ("flex", True),
                                          ("flex-transposed", False)])
def test_flex_train_step_matches_dense(parallel_1x1, backend, hard):
    torch.manual_seed(0)
    reference = build_gpt_model(tiny_config(2), VOCAB, 256,
                                dmc=DMCRuntime(DMCConfig(**SETTINGS)))
    for layer in dmc_layers(reference):
        with torch.no_grad():
            layer.linear_qkv.weight[decision_rows(layer)] *= 5.0
    state = reference.state_dict()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 200), generator=gen).cuda()
    positions = torch.arange(200, device="cuda").expand(2, 200)
    dense_loss, dense = train_step_grads("dense", hard, state, tokens, positions)
    flex_loss, flex = train_step_grads(backend, hard, state, tokens, positions)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)
    assert flex.keys() == dense.keys() and any("linear_qkv" in n for n in dense)
    for name, grad in dense.items():
        error = float((flex[name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert error < 2e-3, name
