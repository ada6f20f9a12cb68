"""Tiny megatron Llama models shared by the tests (2 layers, hidden 64, 4 heads, head_dim 16)."""
import torch

from dmc.megatron.attention import dmc_layers
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime

VOCAB = 96


def tiny_config(groups: int, **overrides):
    """2 layers, hidden 64, 4 query heads in ``groups`` KV groups, FFN 96."""
    return llama_transformer_config(2, 64, 4, 96, num_query_groups=groups, **overrides)


def decision_rows(layer) -> list[int]:
    """Rows of ``layer.linear_qkv.weight`` producing q[..., -1] of every query head and k[..., -1]
    of every KV head. Megatron's fused QKV rows are grouped per KV group:
    ``[q_1 .. q_{heads/groups}, k, v]``, each ``head_dim`` rows."""
    dim = layer.hidden_size_per_attention_head
    groups = layer.num_query_groups_per_partition
    per_group = layer.num_attention_heads_per_partition // groups
    return [g * (per_group + 2) * dim + i * dim + dim - 1
            for g in range(groups) for i in range(per_group + 1)]


def spread_decisions(model, scale: float = 0.4) -> None:
    """Scales the decision rows (init std 0.02) to std ``scale`` so that hard decisions mix
    appends and merges."""
    for layer in dmc_layers(model):
        with torch.no_grad():
            layer.linear_qkv.weight[decision_rows(layer)] *= scale / 0.02


def build_tiny(groups: int, window="vanilla", c: float = -1.0, *, max_seq: int = 160,
               scale: float = 0.4, seed: int = 0, vocab: int = VOCAB, omega_offset: float = 0.0):
    """``(model, runtime)``: a vanilla model (runtime None) when ``window == "vanilla"``, else a
    DMC model in eval mode with spread decisions (``c < 0`` merges long runs)."""
    torch.manual_seed(seed)
    config = tiny_config(groups)
    if window == "vanilla":
        return build_gpt_model(config, vocab, max_seq), None
    runtime = DMCRuntime(DMCConfig(window=window, c=c, omega_offset=omega_offset))
    model = build_gpt_model(config, vocab, max_seq, dmc=runtime)
    spread_decisions(model, scale)
    runtime.set_mode("eval")
    return model, runtime


def assert_same_train_step(models, tokens, positions) -> None:
    """One train-mode step (target CR 2) of each ``(model, runtime)`` pair on ``tokens``: the
    losses equal to float32 rounding and every parameter gradient within a 1e-4 relative norm
    of the last pair's (float32 sums in other orders), the decision rows' among them."""
    results = []
    for model, runtime in models:
        runtime.set_mode("train")
        runtime.target_cr = 2.0
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    want_loss, want = results[-1]
    assert any("linear_qkv" in n for n in want)
    for loss, grads in results[:-1]:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == want.keys()
        for name, grad in want.items():
            assert float((grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)) < 1e-4, name
