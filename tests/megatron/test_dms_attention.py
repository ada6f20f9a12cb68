"""DMSSelfAttention (``dmc.method: dms``) inside a tiny megatron GPTModel (single process, CPU):
train mode against a float64 reference built from the layer's own q/k/v and the float64
delayed-eviction mask, train (hard, no noise) == eval, the zero-out phase, the borrowed rows and
the CR loss against a float64 Eq. 10."""
import dataclasses
import math

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dmc.megatron.attention import decision_rows, dmc_layers, zero_decision_rows_
from dmc.megatron.dms_attention import DMSSelfAttention
from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.ops.reference import compression_loss_reference, dms_attention_bias_reference

from tiny_models import assert_same_train_step, tiny_config

VOCAB, SEQ, HEADS, DIM = 96, 24, 4, 16


def _dms_model(groups=2, seed=0, spread=0.1, qk_norm=False, **dms):
    """A DMS model (eval mode) whose borrowed rows have std ``spread``, so hard decisions mix
    keeping and evicting; ``dms`` are :class:`DMCConfig` fields. ``qk_norm``: per-head q/k
    RMSNorms (Qwen3) with weights drawn around 1."""
    torch.manual_seed(seed)
    settings = dict(method="dms", dms_window=3, c=0.0, dms_logit_scale=10.0, tau=1.0)
    runtime = DMCRuntime(DMCConfig(**{**settings, **dms}))
    model = build_gpt_model(tiny_config(groups, qk_layernorm=qk_norm), VOCAB, 64, dmc=runtime)
    for name, param in model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            with torch.no_grad():
                param.copy_(1 + 0.3 * torch.randn_like(param))
    for layer in dmc_layers(model):
        with torch.no_grad():
            layer.linear_qkv.weight[decision_rows(layer)] *= spread / 0.02
    runtime.set_mode("eval")
    return model, runtime


def _large_rotated_channel(layer, factor=50.0):
    """Scales channel d/2 - 1 of the borrowed query heads, which rotate-half RoPE moves into
    the borrowed last channel, as trained models have it large."""
    with torch.no_grad():
        layer.linear_qkv.weight[[row - DIM // 2 for row in decision_rows(layer)]] *= factor


def _batch(batch=2, seq=SEQ, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return tokens, torch.arange(seq).expand(batch, seq)


def _first_heads(groups):
    return list(range(0, HEADS, HEADS // groups))


def _rope_angles(positions, dim=DIM, base=10000.0):
    """``[seq, dim]`` float64 rotate-half RoPE angles (both halves)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv[None]
    return torch.cat([angles, angles], dim=-1)


def _rope64(x, angles):
    """Float64 rotate-half RoPE of ``x [seq, batch, heads, dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angles.cos()[:, None, None] + rotated * angles.sin()[:, None, None]


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
@pytest.mark.parametrize("groups", [2, 1])
def test_train_mode_layer_equals_float64_reference(parallel_1x1, hard, groups):
    """One DMS layer in train mode (Gumbel noise, delayed eviction, window 3) equals float64
    attention built from the layer's own q/k/v, its noise and the float64 reference mask.
    Positions start at 3000 so RoPE moves much of channel d/2 - 1 into the borrowed last one,
    which must be zeroed after RoPE too."""
    model, runtime = _dms_model(groups, hard=hard)
    layer = dmc_layers(model)[1]
    _large_rotated_channel(layer)
    runtime.set_mode("train")
    cfg = runtime.config
    seq, batch = SEQ, 2
    hidden = torch.randn(seq, batch, 64, generator=torch.Generator().manual_seed(1))
    angles = _rope_angles(torch.arange(3000, 3000 + seq))
    freqs = angles[:, None, None, :].float()
    with torch.no_grad():
        output, _ = layer(hidden, None, rotary_pos_emb=freqs)
        q, k, v = (t.double() for t in layer.get_query_key_value_tensors(hidden))
        heads = _first_heads(groups)
        logit = (q[:, :, heads, -1] * cfg.dms_logit_scale - cfg.c).permute(1, 2, 0)  # [b, g, s]
        noise = layer._noise(logit.float()).double()
        alpha = torch.sigmoid((logit + noise) / cfg.tau)
        alpha[..., 0] = 0
        if hard:
            alpha = (alpha > 0.5).double()
        q[:, :, heads, -1] = 0
        q, k = _rope64(q, angles), _rope64(k, angles)
        q[:, :, heads, -1] = 0
        group = HEADS // groups
        to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
        q, k, v = to_bhsd(q), to_bhsd(k).repeat_interleave(group, 1), to_bhsd(v)
        bias = dms_attention_bias_reference(alpha, cfg.dms_window).repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        v = v.repeat_interleave(group, 1)
        project = lambda ctx: ctx.permute(2, 0, 1, 3).reshape(seq, batch, -1) @ (  # noqa: E731
            layer.linear_proj.weight.double().T)
        reference = project((scores + bias).softmax(-1) @ v)
        causal = torch.full((seq, seq), -math.inf, dtype=torch.float64).triu(1)
        no_eviction = project((scores + causal).softmax(-1) @ v)
    assert 0.2 < (alpha[..., 1:] > 0.5).double().mean() < 0.8, "decisions should mix"
    torch.testing.assert_close(output.double(), reference, rtol=1e-4, atol=1e-5)
    assert (no_eviction - reference).abs().max() > 1e-3  # the evictions matter
    kept = (1 - alpha).sum(dim=(0, 2))
    torch.testing.assert_close(layer.cr_kept, kept, rtol=1e-5, atol=1e-4)


def _without_noise(model):
    for layer in dmc_layers(model):
        layer._noise = lambda logit: torch.zeros_like(logit, dtype=torch.float32)


@pytest.mark.parametrize("groups", [2, 1])
def test_train_hard_without_noise_equals_eval(parallel_1x1, groups):
    model, runtime = _dms_model(groups, hard=True)
    _without_noise(model)
    tokens, positions = _batch()
    out = {}
    with torch.no_grad():
        for mode in ("eval", "train"):
            runtime.set_mode(mode)
            for layer in dmc_layers(model):
                layer.reset_cr_stats()
            out[mode] = (model(tokens, positions, None),
                         torch.stack([layer.cr_kept.clone() for layer in dmc_layers(model)]))
        runtime.set_mode("vanilla")
        vanilla = model(tokens, positions, None)
    torch.testing.assert_close(out["train"][0], out["eval"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["train"][1], out["eval"][1], rtol=0, atol=0)
    kept_fraction = out["eval"][1].sum().item() / (2 * groups * 2 * SEQ)
    assert 0.2 < kept_fraction < 0.8, kept_fraction
    assert (out["eval"][0] - vanilla).abs().max() > 1e-2  # evictions change the logits


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk_layernorm"])
def test_zero_out_phase(parallel_1x1, qk_norm):
    """Scale 1 is the vanilla model; scale 0 is the eval model with no eviction (c huge) after
    zero_decision_rows_, and the zero_out model after it (the channel is scaled after RoPE too,
    which matters at 64 positions with a large channel d/2 - 1); only the borrowed rows are
    zeroed. With q_norm the channel is scaled before the norm (the RMS couples it to the
    head's other channels), so the hand-off is exact there too; Llama's eval model equals
    scale 0 before the hand-off as well."""
    model, runtime = _dms_model(2, c=1e4, qk_norm=qk_norm)
    for layer in dmc_layers(model):
        _large_rotated_channel(layer)
    tokens, positions = _batch(seq=64)
    with torch.no_grad():
        runtime.set_mode("vanilla")
        vanilla = model(tokens, positions, None)
        runtime.set_mode("zero_out")
        runtime.zero_out_scale = 1.0
        torch.testing.assert_close(model(tokens, positions, None), vanilla, rtol=0, atol=0)
        runtime.zero_out_scale = 0.0
        scaled_to_zero = model(tokens, positions, None)
        assert (scaled_to_zero - vanilla).abs().max() > 1e-4
        runtime.set_mode("eval")
        no_eviction = model(tokens, positions, None)
        assert all(layer.cr_kept.sum() == 2 * 64 * 2 for layer in dmc_layers(model))
        weights = {name: p.clone() for name, p in model.named_parameters()}
        assert zero_decision_rows_(model) == 2
        runtime.set_mode("zero_out")
        after = model(tokens, positions, None)
        runtime.set_mode("eval")
        eval_after = model(tokens, positions, None)
    if not qk_norm:
        torch.testing.assert_close(no_eviction, scaled_to_zero, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, scaled_to_zero, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(eval_after, scaled_to_zero, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        changed = (param != weights[name]).nonzero()
        if "linear_qkv" in name:
            layer = dmc_layers(model)[int(name.split(".")[2])]
            assert sorted(set(changed[:, 0].tolist())) == decision_rows(layer), name
        else:
            assert not len(changed), name


@pytest.mark.parametrize("groups", [2, 1])
def test_decision_rows_are_the_first_query_head_last_channel(parallel_1x1, groups):
    model, _ = _dms_model(groups)
    layer = dmc_layers(model)[0]
    assert isinstance(layer, DMSSelfAttention) and layer.method == "dms"
    per_group = HEADS // groups
    assert decision_rows(layer) == [g * (per_group + 2) * DIM + DIM - 1 for g in range(groups)]
    hidden = torch.randn(5, 2, 64)
    with torch.no_grad():
        before = layer.get_query_key_value_tensors(hidden)
        zero_decision_rows_(model)
        after = layer.get_query_key_value_tensors(hidden)
    borrowed = torch.zeros_like(before[0], dtype=torch.bool)
    borrowed[:, :, _first_heads(groups), -1] = True
    assert (after[0][borrowed] == 0).all() and (before[0][borrowed] != 0).all()
    assert torch.equal(after[0][~borrowed], before[0][~borrowed])
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])


def _capture_alphas(model) -> list:
    """Each layer's alphas ``[batch, kv_heads, seq]`` of each forward, in layer order."""
    captured = []
    for layer in dmc_layers(model):
        def record(alpha_logit, decide=layer._decisions):
            alpha, log_keep = decide(alpha_logit)
            captured.append(alpha)
            return alpha, log_keep
        layer._decisions = record
    return captured


@pytest.mark.parametrize("prior", ["global", "local"])
@pytest.mark.parametrize("hard_loss", [False, True])
def test_cr_loss_is_eq10_and_reaches_only_the_borrowed_rows(parallel_1x1, prior, hard_loss):
    model, runtime = _dms_model(2, prior=prior, hard_loss=hard_loss)
    runtime.set_mode("train")
    tokens, positions = _batch(batch=3)
    alphas = _capture_alphas(model)
    with torch.no_grad():  # the same noise as the forward below (keyed by step, micro-batch)
        model(tokens, positions, None)
    alpha = torch.stack(alphas, dim=1).double()  # [batch, layers, heads, seq]
    counted = (alpha > 0.5).double() if hard_loss else alpha
    kept_fraction = (1 - counted).mean(dim=(1, 2, 3))
    runtime.target_cr = 2 / (kept_fraction.min() + kept_fraction.max()).item()
    logits = model(tokens, positions, None)
    cr_loss = sum(runtime.pop_cr_losses())
    want = compression_loss_reference(counted, runtime.target_cr, prior)
    assert cr_loss.item() == pytest.approx(want, abs=1e-6) and want > 1e-3
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # a class attribute: other tests set it
    (logits.sum() * 0).backward()  # only the attached CR loss produces gradients
    last = dmc_layers(model)[-1]  # its alphas reach the loss directly only
    grad_rows = last.linear_qkv.weight.grad.abs().sum(dim=1).nonzero()[:, 0].tolist()
    assert grad_rows == decision_rows(last)


def test_flex_backend_matches_dense(parallel_1x1):
    dense, dense_rt = _dms_model(2, attention_backend="dense")
    flex, flex_rt = _dms_model(2, attention_backend="flex")
    flex.load_state_dict(dense.state_dict())
    tokens, positions = _batch()
    with torch.no_grad():
        for mode in ("train", "eval"):
            dense_rt.set_mode(mode)
            flex_rt.set_mode(mode)
            torch.testing.assert_close(flex(tokens, positions, None),
                                       dense(tokens, positions, None), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
def test_flex_transposed_train_step_wired_end_to_end(parallel_1x1, monkeypatch, hard):
    """A DMS train-mode step through flex-transposed (``auto``'s choice for DMS on CUDA) with
    FlexAttention replaced by a plain-torch one (:mod:`flex_reference`; it has no CPU
    backward): the loss and every parameter gradient equal the dense backend's."""
    import torch.nn.attention.flex_attention as flex_module

    from flex_reference import reference_flex

    monkeypatch.setattr(flex_module, "flex_attention", reference_flex)
    assert_same_train_step([_dms_model(2, attention_backend=backend, hard=hard)
                            for backend in ("flex-transposed", "dense")], *_batch())


def test_a_runtime_of_another_method_is_refused(parallel_1x1):
    model, runtime = _dms_model(2)
    runtime.config = dataclasses.replace(runtime.config, method="dmc")
    tokens, positions = _batch()
    with pytest.raises(ValueError, match="dmc.method is 'dmc' but this layer was built for 'dms'"):
        model(tokens, positions, None)
