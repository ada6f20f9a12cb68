"""DMCSelfAttention inside a tiny megatron GPTModel (single process, CPU)."""
import pytest
import torch

from dmc.megatron.attention import dmc_layers, zero_decision_rows_
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.ops import compression_loss_from_sums

from llama_reference import decode_with_compressed_cache
from tiny_models import spread_decisions, tiny_config

VOCAB, SEQ = 96, 24


def _batch(batch=2, seq=SEQ, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return tokens, torch.arange(seq).expand(batch, seq)


def _pair(groups, dmc_config=None):
    """A vanilla model and a DMC model with the same weights."""
    config = tiny_config(groups)
    vanilla = build_gpt_model(config, VOCAB, 64)
    runtime = DMCRuntime(dmc_config or DMCConfig())
    dmc = build_gpt_model(config, VOCAB, 64, dmc=runtime)
    dmc.load_state_dict(vanilla.state_dict())
    return vanilla, dmc, runtime


@pytest.mark.parametrize("groups", [4, 2])
def test_at_initialisation_dmc_matches_vanilla(parallel_1x1, groups):
    vanilla, dmc, runtime = _pair(groups)
    zero_decision_rows_(dmc)
    vanilla.load_state_dict(dmc.state_dict())
    tokens, positions = _batch()
    with torch.no_grad():
        reference = vanilla(tokens, positions, None)
        for mode in ("eval", "train"):
            runtime.set_mode(mode)
            logits = dmc(tokens, positions, None)
            rel = ((logits - reference).norm() / reference.norm()).item()
            assert rel < 1e-3, (mode, rel)


@pytest.mark.parametrize("groups,window", [(4, None), (2, None), (2, SEQ)])
def test_eval_mode_equals_token_by_token_compressed_cache(parallel_1x1, groups, window):
    _, dmc, runtime = _pair(groups, DMCConfig(window=window, c=0.5))
    spread_decisions(dmc)
    runtime.set_mode("eval")
    tokens, positions = _batch()
    with torch.no_grad():
        logits = dmc(tokens, positions, None)
    reference, sizes = decode_with_compressed_cache(
        dmc.state_dict(), tokens, num_layers=2, num_heads=4, num_groups=groups,
        eps=1e-5, rotary_base=10000.0, c=0.5,
    )
    cache_tokens = sizes.sum().item()
    assert SEQ * 2 * 2 * groups / cache_tokens > 1.3, "decisions should compress"
    torch.testing.assert_close(logits.double(), reference, rtol=1e-4, atol=1e-4)
    measured_kept = sum(layer.cr_kept.sum().item() for layer in dmc_layers(dmc))
    assert measured_kept == cache_tokens


def test_vanilla_reference_decoder_matches_megatron(parallel_1x1):
    vanilla, _, _ = _pair(2)
    tokens, positions = _batch(batch=1, seq=10)
    with torch.no_grad():
        logits = vanilla(tokens, positions, None)
    reference, _ = decode_with_compressed_cache(
        vanilla.state_dict(), tokens, num_layers=2, num_heads=4, num_groups=2, eps=1e-5,
        rotary_base=10000.0, dmc=False,
    )
    torch.testing.assert_close(logits.double(), reference, rtol=1e-4, atol=1e-5)


def test_zero_out_scales_decision_channels(parallel_1x1):
    vanilla, dmc, runtime = _pair(2)
    tokens, positions = _batch()
    runtime.set_mode("zero_out")
    with torch.no_grad():
        runtime.zero_out_scale = 1.0
        torch.testing.assert_close(dmc(tokens, positions, None), vanilla(tokens, positions, None))
        runtime.zero_out_scale = 0.0
        scaled_to_zero = dmc(tokens, positions, None)
        assert zero_decision_rows_(dmc) == 2
        runtime.set_mode("vanilla")
        torch.testing.assert_close(dmc(tokens, positions, None), scaled_to_zero)
        layer = dmc_layers(dmc)[0]
        query, key, _ = layer.get_query_key_value_tensors(torch.randn(5, 2, 64))
    assert (query[..., -1] == 0).all() and (key[..., -1] == 0).all()
    assert (query[..., :-1] != 0).any()


def test_train_mode_cr_loss_and_gradients(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0))
    spread_decisions(dmc, scale=2.0)
    runtime.set_mode("train")
    runtime.target_cr = 4.0
    tokens, positions = _batch()
    for layer in dmc_layers(dmc):
        layer.reset_cr_stats()
    logits = dmc(tokens, positions, None)
    (cr_loss,) = runtime.pop_cr_losses()
    kept = sum(layer.cr_kept.sum() for layer in dmc_layers(dmc))
    count = sum(layer.cr_count.item() * layer.cr_kept.numel() for layer in dmc_layers(dmc))
    expected = compression_loss_from_sums(kept, count, 4.0)
    assert cr_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert cr_loss.item() > 0
    (logits.sum() * 0).backward()  # only the attached CR loss produces gradients
    grad = dmc_layers(dmc)[0].linear_qkv.weight.grad
    k_row = 2 * 16 + 15  # group 0: [q0, q1, k, v], 16 channels each
    assert grad[k_row].abs().sum() > 0
    assert torch.isfinite(grad).all()


def test_noise_is_keyed_by_step_and_microbatch(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0))
    spread_decisions(dmc, scale=0.5)
    runtime.set_mode("train")
    tokens, positions = _batch()
    with torch.no_grad():
        first = dmc(tokens, positions, None)
        torch.manual_seed(99)  # global RNG state must not matter
        again = dmc(tokens, positions, None)
        runtime.step += 1
        other = dmc(tokens, positions, None)
    torch.testing.assert_close(first, again)
    assert (first - other).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_flex_backend_matches_dense(parallel_1x1, mode):
    _, dense_model, dense_rt = _pair(2, DMCConfig(window=4, c=0.0, attention_backend="dense"))
    spread_decisions(dense_model, scale=1.0)
    flex_rt = DMCRuntime(DMCConfig(window=4, c=0.0, attention_backend="flex"))
    flex_model = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=flex_rt)
    flex_model.load_state_dict(dense_model.state_dict())
    dense_rt.set_mode(mode)
    flex_rt.set_mode(mode)
    tokens, positions = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            flex_model(tokens, positions, None), dense_model(tokens, positions, None),
            rtol=1e-4, atol=1e-4,
        )


def test_hard_straight_through_training_is_finite(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, hard=True))
    spread_decisions(dmc, scale=1.0)
    runtime.set_mode("train")
    runtime.target_cr = 2.0
    tokens, positions = _batch()
    loss = dmc(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in dmc.parameters() if p.grad is not None)


def test_bad_settings_fail_clearly(parallel_1x1):
    with pytest.raises(ValueError, match="mode must be one of"):
        DMCRuntime().set_mode("inference")
    with pytest.raises(ValueError, match="dmc.window"):
        DMCConfig(window=0)
    with pytest.raises(ValueError, match="attention_dropout"):
        build_gpt_model(
            llama_transformer_config(1, 32, 2, 64, attention_dropout=0.1), VOCAB, 16,
            dmc=DMCRuntime(),
        )
