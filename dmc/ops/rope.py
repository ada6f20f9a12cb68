"""Rotary position embedding (rotate-half, as Hugging Face Llama and megatron-core), with the
Llama 3.x frequency scaling.

Torch only, relative imports only: the Hugging Face export ships this file next to
``modeling_dmc.py``.
"""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, base: float = 10000.0, device=None,
                  llama3_scaling: dict | None = None) -> torch.Tensor:
    """``base ** (-arange(0, d, 2) / d)`` as float32 ``[head_dim // 2]``.

    ``llama3_scaling``: None or ``{factor, low_freq_factor (1), high_freq_factor (4),
    original_max_position_embeddings (8192)}``: long wavelengths are divided by ``factor``,
    short ones kept, the band between interpolated (Llama 3.1's ``rope_type="llama3"``).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (base**exponent)
    if not llama3_scaling:
        return inv_freq
    factor = llama3_scaling["factor"]
    low = llama3_scaling.get("low_freq_factor", 1.0)
    high = llama3_scaling.get("high_freq_factor", 4.0)
    old_len = llama3_scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_angles(positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines of the angles ``position * inv_freq`` of positions ``[...]``: two
    float32 tables ``[..., head_dim // 2]``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def rope_tables(positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of positions ``[...]`` as two tables ``[..., head_dim]`` for
    :func:`rotate`: the cosines of :func:`rope_angles` (each half), and their sines with the
    first half negated (rotate-half's sign folded in)."""
    cos, sin = rope_angles(positions, inv_freq)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., head_dim]`` with tables of :func:`rope_tables`
    (broadcastable against ``x``): ``x * cos + roll(x, head_dim / 2) * sin``, i.e. the halves
    ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``. A decode step computes the tables once
    for all its layers."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def rotation_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate`'s tables from the angles ``[..., head_dim]`` (each half's, as
    megatron-core's rotary embedding gives them), rounded to ``dtype`` as megatron-core's unfused
    rotate-half RoPE rounds its cosines and sines before its products: with them :func:`rotate`
    equals that RoPE bit for bit (``x2 * -sin`` is ``-x2 * sin`` exactly)."""
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    half = angles.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin`` with angles ``position * inv_freq``.

    Args:
        x: ``[..., head_dim]`` float32.
        positions: ``[...]`` integer positions, broadcastable against ``x[..., 0]``.
        inv_freq: ``[head_dim // 2]`` float32.
    """
    return rotate(x, *rope_tables(positions, inv_freq))
