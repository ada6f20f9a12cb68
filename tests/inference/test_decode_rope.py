"""The Triton RoPE of decode rows (the interpreter on CPU) against float64 RoPE and against the
PyTorch decode path it replaces (rotate, and for DMC hard_decisions' channels)."""
import pytest
import torch

from dmc.inference.kernels import DecisionChannel, EvictionChannel, run_decode_rope
from dmc.ops import split_dms_channels, zero_decision_channel, zero_dms_channel
from dmc.ops.algorithm1 import hard_decisions
from dmc.ops.rope import rope_inv_freq, rope_tables, rotate


def step_rows(batch, heads, dim, dtype, seed=0, channel_scale=1.0):
    """Decode rows ``[batch, heads, dim]`` as the model runner gets them (a strided view of
    ``[batch, 1, heads, dim]``), with ``channel_scale`` spreading the last channel, and the
    step's RoPE tables at scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, heads, dim, generator=gen)
    x[..., -1] *= channel_scale
    positions = torch.randint(0, 4096, (batch,), generator=gen)
    cos, sin = rope_tables(positions[:, None], rope_inv_freq(dim, 10000.0))
    return x.to(dtype)[:, 0], positions, cos, sin


def rope_float64(x, positions):
    """Rotate-half RoPE in float64 from the angles, independent of rope_tables (float32 angles
    at positions up to 4096 are off by up to ~3e-4 radians: compare to 1e-3)."""
    dim = x.shape[-1]
    angles = positions[:, None, None].double() * rope_inv_freq(dim, 10000.0).double()
    lo, hi = x.double()[..., :dim // 2], x.double()[..., dim // 2:]
    return torch.cat([lo * angles.cos() - hi * angles.sin(),
                      hi * angles.cos() + lo * angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(4, 16), (6, 10)])
def test_rotation_matches_float64_and_rotate(dtype, heads, dim):
    x, positions, cos, sin = step_rows(3, heads, dim, dtype)
    out, omega = run_decode_rope(x, cos, sin)
    assert omega is None and out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), rope_float64(x, positions), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out, rotate(x.float(), cos, sin), atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 4), (6, 2)])
@pytest.mark.parametrize("c,offset", [(5.0, 0.0), (2.0, 2.0 ** -7)])
def test_decision_channel_matches_hard_decisions(dtype, q_heads, kv_heads, c, offset):
    """The importance equals hard_decisions' (each step rounded to the dtype, as PyTorch's ops
    round theirs: bfloat16 bit for bit, float32 to an ulp of the mean's summation order), the
    floor included (channels far below -c); the rotated query equals the PyTorch path's:
    channel zeroed, rotated, zeroed again."""
    x, positions, cos, sin = step_rows(5, q_heads, 16, dtype, seed=q_heads, channel_scale=40.0)
    x[0, :, -1] = -200.0  # sigmoid underflows: omega floored at OMEGA_MIN (offset 0)
    key = torch.zeros(5, kv_heads, 1, 16, dtype=dtype)
    out, omega = run_decode_rope(x, cos, sin, DecisionChannel(kv_heads, c, offset))
    decided = hard_decisions(x[:, :, None], key, c, offset)
    if dtype == torch.bfloat16:
        assert torch.equal(omega, decided.omega[..., 0])
    torch.testing.assert_close(omega, decided.omega[..., 0], atol=0, rtol=2e-7)
    expected = zero_decision_channel(rotate(decided.query[:, :, 0].float(), cos, sin))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert out[..., -1].eq(0).all()
    reference = rope_float64(zero_decision_channel(x), positions)
    torch.testing.assert_close(out.double(), zero_decision_channel(reference), atol=1e-3,
                               rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 4), (6, 2)])
def test_eviction_channel_matches_split_dms_channels(dtype, q_heads, kv_heads):
    """DMS: the eviction of each group's first head equals split_dms_channels' bit for bit
    (about half of the logits above c), the rotated query the PyTorch path's (that channel
    zeroed, rotated, zeroed again; every other head's last channel kept)."""
    c, scale = 5.0, 100.0
    x, positions, cos, sin = step_rows(7, q_heads, 16, dtype, seed=q_heads, channel_scale=0.1)
    x[..., -1] += 0.05  # logits q * 100 - 5 around 0
    out, evict = run_decode_rope(x, cos, sin, EvictionChannel(kv_heads, c, scale))
    channels = split_dms_channels(x[:, :, None], kv_heads, c, scale)
    assert evict.dtype == torch.bool and torch.equal(evict, channels.alpha_logit[..., 0] > 0)
    assert 0 < evict.float().mean() < 1
    rotated = rotate(channels.query.float(), cos[:, :, None], sin[:, :, None])
    expected = zero_dms_channel(rotated, kv_heads)[:, :, 0]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert out[:, ::q_heads // kv_heads, -1].eq(0).all()
    if q_heads > kv_heads:
        assert out[:, 1::q_heads // kv_heads, -1].ne(0).all()


def test_uneven_groups_are_refused():
    x, _, cos, sin = step_rows(2, 6, 16, torch.float32)
    with pytest.raises(ValueError, match="6 heads of dim 16 do not split into 4 groups"):
        run_decode_rope(x, cos, sin, DecisionChannel(4, 5.0))
