"""dmc.ops.rope's tables from megatron-core's angles, and the rotation without the decision
channel (dmc.ops.decisions.without_decision_channel) against float64 loops."""
import math

import pytest
import torch

from dmc.ops import without_decision_channel, zero_decision_channel
from dmc.ops.rope import rope_inv_freq, rope_tables, rotate, rotation_tables


def _rotate_half_loop(x, angles):
    """Rotate-half RoPE channel by channel in float64: ``out[j] = x[j] cos(a_j) - x[j + h]
    sin(a_j)`` and ``out[j + h] = x[j + h] cos(a_{j+h}) + x[j] sin(a_{j+h})``."""
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    for j in range(half):
        out[..., j] = x[..., j] * angles[..., j].cos() - x[..., j + half] * angles[..., j].sin()
        out[..., j + half] = (x[..., j + half] * angles[..., j + half].cos()
                              + x[..., j] * angles[..., j + half].sin())
    return out


def _angles(seq, dim):
    """megatron-core's layout: each position's angles, the half repeated, ``[seq, dim]``."""
    half = torch.arange(seq, dtype=torch.float64)[:, None] * rope_inv_freq(dim).double()
    return torch.cat([half, half], dim=-1)


@pytest.mark.parametrize("dim", [8, 64])
def test_rotation_tables_rotate_as_rotate_half(dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, dim, generator=gen, dtype=torch.float64)
    angles = _angles(50, dim)
    torch.testing.assert_close(rotate(x, *rotation_tables(angles, torch.float64)),
                               _rotate_half_loop(x, angles), rtol=1e-12, atol=1e-12)


def test_rotation_tables_equal_the_position_tables():
    inv_freq = rope_inv_freq(16)
    positions = torch.arange(40)
    angles = positions.float()[:, None] * inv_freq
    for ours, theirs in zip(rotation_tables(torch.cat([angles, angles], -1), torch.float32),
                            rope_tables(positions, inv_freq)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dim", [8, 64])
def test_without_decision_channel_is_zeroing_around_the_rotation(dim):
    """Zero the last channel, rotate, zero it again: one rotation through the tables."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 70, dim, generator=gen, dtype=torch.float64)
    angles = _angles(70, dim)
    expected = zero_decision_channel(_rotate_half_loop(zero_decision_channel(x), angles))
    got = rotate(x, *without_decision_channel(*rotation_tables(angles, torch.float64)))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got[..., -1].eq(0).all()
    # the input's last channel reaches no output: its gradient is 0, the others' are not
    x.requires_grad_()
    rotate(x, *without_decision_channel(*rotation_tables(angles, torch.float64))).sum().backward()
    assert x.grad[..., -1].eq(0).all() and x.grad[..., :-1].abs().sum() > 0


def _llama3_inv_freq_loop(dim, base, factor, low, high, old_len):
    """Meta's ``apply_scaling`` (Llama 3.1 reference code) frequency by frequency in float64:
    wavelengths under ``old_len / high`` kept, over ``old_len / low`` divided by ``factor``, the
    band between interpolated with ``smooth = (old_len / wavelen - low) / (high - low)``."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dim,base,scaling,medium", [
    # Llama 3.1 8B: 6 of its 64 frequencies in the interpolated band
    (128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, 6),
    (64, 10000.0, {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 2048}, 5),
    (64, 500000.0, {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 8192}, 3),
])
def test_llama3_inv_freq_equals_metas_apply_scaling_in_every_band(dim, base, scaling, medium):
    """Every entry of rope_inv_freq with llama3 scaling equals a float64 loop of Meta's
    apply_scaling, the medium (interpolated) band included."""
    want = _llama3_inv_freq_loop(dim, base, scaling["factor"], scaling["low_freq_factor"],
                                 scaling["high_freq_factor"],
                                 scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi * base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    old_len = scaling["original_max_position_embeddings"]
    in_band = (wavelen >= old_len / scaling["high_freq_factor"]) & (
        wavelen <= old_len / scaling["low_freq_factor"])
    assert int(in_band.sum()) == medium  # the interpolated band is exercised
    got = rope_inv_freq(dim, base, llama3_scaling=scaling)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
