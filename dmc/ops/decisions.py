"""Append/merge decisions and importance weights (Sec. 3.1 and 3.2 of the DMC paper).

Each KV head gives up one key channel for the decision logit and one query channel for the
importance logit; no parameter is added. Convention (NVIDIA's released DMC code): the **last**
channel of the head, ``alpha_logit = k[..., -1] - c`` and
``omega = sigmoid(q[..., -1] + c) + omega_offset`` (:func:`importance`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .mask import log_keep_next, log_keep_next_from_logits

DECISION_CHANNEL = -1
OMEGA_MIN = 1e-6


class DecisionChannels(NamedTuple):
    """What :func:`split_decision_channels` returns.

    query: ``[batch, q_heads, seq, dim]`` with the decision channel zeroed.
    key: ``[batch, kv_heads, seq, dim]`` with the decision channel zeroed.
    alpha_logit: ``[batch, kv_heads, seq]``, ``k[..., -1] - c``.
    omega: ``[batch, kv_heads, seq]``, :func:`importance` of the group's mean ``q[..., -1]``.
    """

    query: torch.Tensor
    key: torch.Tensor
    alpha_logit: torch.Tensor
    omega: torch.Tensor


def logistic_noise(shape, *, generator=None, device=None, dtype=torch.float32) -> torch.Tensor:
    """Samples ``g1 - g2`` for two independent Gumbel(0, 1) variables, i.e. Logistic(0, 1).

    Drawn as ``log(u) - log(1 - u)`` with ``u ~ U(0, 1)`` kept away from 0 and 1.
    """
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    u = u.clamp(tiny, 1.0 - torch.finfo(torch.float32).eps)
    return (torch.log(u) - torch.log1p(-u)).to(dtype)


def gumbel_sigmoid(
    logits: torch.Tensor,
    tau: float,
    generator: torch.Generator | None = None,
    hard: bool = False,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stochastic relaxation of a Bernoulli(sigmoid(logits)) decision (Eq. 8 of the paper).

    ``alpha = sigmoid((logits + g1 - g2) / tau)`` with ``g1, g2 ~ Gumbel(0, 1)``, so that
    ``P(alpha > 0.5) = sigmoid(logits)``. With ``hard=True`` the forward value is
    ``round(alpha)`` and the gradient is that of the soft sample (straight-through).

    Args:
        logits: any shape.
        tau: temperature > 0 (0.1 in the paper).
        generator: source of the noise (ignored when ``noise`` is given).
        hard: straight-through hard decisions.
        noise: optional pre-drawn Logistic(0, 1) noise, same shape as ``logits``.
    """
    if tau <= 0:
        raise ValueError(f"gumbel_sigmoid: tau must be > 0, got {tau}")
    if noise is None:
        noise = logistic_noise(logits.shape, generator=generator, device=logits.device)
    alpha = torch.sigmoid(relaxed_logits(logits, noise, tau))
    if hard:
        alpha = straight_through_round(alpha)
    return alpha.to(logits.dtype)


def relaxed_logits(logits: torch.Tensor, noise: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 8's argument ``(logits + g1 - g2) / tau`` in float32 (float64 stays float64),
    ``noise = g1 - g2`` drawn Logistic(0, 1): its sigmoid is the relaxed decision, its
    ``logsigmoid(-.)`` the stable ``log(1 - alpha)`` of App. H."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (logits.to(work) + noise.to(work)) / tau


def relaxed_decisions(alpha_logit: torch.Tensor, noise: torch.Tensor, tau: float,
                      hard: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A training forward's decisions from their logits ``[batch, heads, seq]`` and drawn
    Logistic(0, 1) ``noise`` (float32, same shape): ``(alpha, log_keep)``.

    ``alpha = sigmoid((alpha_logit + noise) / tau)`` (Eq. 8) in the logits' dtype, with
    ``alpha_0 = 0`` (the first token opens a slot), and ``log(1 - alpha_{j+1})`` computed
    stably from the same sample (App. H, :func:`dmc.ops.mask.log_keep_next_from_logits`), both
    computed in float32 (float64 logits in float64). ``hard``: both rounded straight-through
    (forward ``alpha > 0.5``, gradient the soft one's). :func:`gumbel_sigmoid` and
    :func:`log_one_minus_gumbel_sigmoid` are the same sample's two halves, for one tensor and
    without ``alpha_0 = 0``; all three take Eq. 8's argument from :func:`relaxed_logits`."""
    scaled = relaxed_logits(alpha_logit, noise, tau)
    soft = torch.sigmoid(scaled)
    log_keep = log_keep_next_from_logits(scaled)
    if hard:
        log_keep = log_keep_next((soft > 0.5).to(soft.dtype)) + (log_keep - log_keep.detach())
        soft = straight_through_round(soft)
    alpha = soft.to(alpha_logit.dtype)
    first = torch.ones_like(alpha)
    first[..., 0] = 0
    return alpha * first, log_keep


def straight_through_round(alpha: torch.Tensor) -> torch.Tensor:
    """Forward value ``round(alpha)`` (``alpha > 0.5``), gradient that of ``alpha``
    (straight-through estimator; NVIDIA's ``get_decisions``)."""
    return (alpha > 0.5).to(alpha.dtype) - alpha.detach() + alpha


def importance(omega_logit: torch.Tensor, c: float, offset: float = 0.0) -> torch.Tensor:
    """``omega = sigmoid(omega_logit + c) + offset`` floored at ``OMEGA_MIN`` (Sec. 3.2: c makes
    omega ~ 1 at initialisation).

    ``offset`` is not in the paper: NVIDIA's released code adds ``torch.finfo(bfloat16).eps``
    (2^-7) to omega in training (bf16 runs) and in its inference kernel, so their checkpoints
    are converted with ``offset = 2**-7``; our own training uses 0. The floor keeps the running
    weight z of Eq. 9 > 0 in float32/bf16 when ``offset`` is 0.
    """
    return (torch.sigmoid(omega_logit + c) + offset).clamp_min(OMEGA_MIN)


def log_one_minus_gumbel_sigmoid(
    logits: torch.Tensor, tau: float, noise: torch.Tensor
) -> torch.Tensor:
    """``log(1 - alpha)`` for the same sample as :func:`gumbel_sigmoid`, computed stably as
    ``logsigmoid(-(logits + noise) / tau)`` (App. H)."""
    return F.logsigmoid(-relaxed_logits(logits, noise, tau))


def split_decision_channels(
    query: torch.Tensor, key: torch.Tensor, c: float = 5.0, omega_offset: float = 0.0
) -> DecisionChannels:
    """Reads the decision logit and importance from the last channel and zeroes both channels.

    Args:
        query: ``[batch, q_heads, seq, dim]``; ``q_heads`` is a multiple of ``kv_heads`` and
            query head ``h`` belongs to KV group ``h // (q_heads // kv_heads)``.
        key: ``[batch, kv_heads, seq, dim]``.
        c: offset so that at initialisation (channel ~ 0) ``alpha ~ sigmoid(-c)`` and
            ``omega ~ sigmoid(c)`` (both ~ 0.0067 away from append-only with full weight).
        omega_offset: added to omega (see :func:`importance`; 2^-7 for NVIDIA's checkpoints).

    Returns:
        :class:`DecisionChannels`. Under GQA the importance logit is the mean of the group's
        query channels; the decision is per KV head.
    """
    alpha_logit, omega = decision_logits(query, key, c, omega_offset)
    return DecisionChannels(
        query=zero_decision_channel(query),
        key=zero_decision_channel(key),
        alpha_logit=alpha_logit,
        omega=omega,
    )


def decision_logits(query: torch.Tensor, key: torch.Tensor, c: float = 5.0,
                    omega_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha_logit, omega)`` of :func:`split_decision_channels`, each ``[batch, kv_heads,
    seq]``, read from ``query [batch, q_heads, seq, dim]`` and ``key [batch, kv_heads, seq,
    dim]`` without copying them with the channels zeroed."""
    batch, q_heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != batch or key.shape[2] != seq or key.shape[3] != dim:
        raise ValueError(
            f"decision channels: key shape {tuple(key.shape)} does not match query shape "
            f"{tuple(query.shape)} (expected [batch, kv_heads, seq, dim])"
        )
    if q_heads % kv_heads:
        raise ValueError(
            f"decision channels: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}"
        )
    omega_logit = query[..., DECISION_CHANNEL].reshape(
        batch, kv_heads, q_heads // kv_heads, seq).mean(dim=2)
    return key[..., DECISION_CHANNEL] - c, importance(omega_logit, c, omega_offset)


class DMSChannels(NamedTuple):
    """What :func:`split_dms_channels` returns.

    query: ``[batch, q_heads, seq, dim]`` with the borrowed channel zeroed (the last channel of
        the first query head of each KV group; every other channel untouched).
    alpha_logit: ``[batch, kv_heads, seq]``, ``q_{first head of group}[..., -1] * scale - c``.
    """

    query: torch.Tensor
    alpha_logit: torch.Tensor


def dms_query_heads(q_heads: int, kv_heads: int) -> list[int]:
    """The query heads whose last channel DMS borrows: the first of each KV group."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return list(range(0, q_heads, q_heads // kv_heads))


def split_dms_channels(query: torch.Tensor, kv_heads: int, c: float = 5.0,
                       scale: float = 100.0) -> DMSChannels:
    """DMS's eviction logit from a borrowed query channel (DMS paper Sec. 3.1, which reuses the
    DMC recipe of borrowing a neuron; NVIDIA Model-Optimizer's ``prepare_attention_input`` with
    ``dms_separate_alpha=False``): ``alpha_logit = q_g[..., -1] * scale - c`` for the first query
    head ``g`` of each KV group, whose channel is then zeroed. Keys keep every channel.

    The caller zeroes the channel again after RoPE (:func:`zero_dms_channel`), as NVIDIA does:
    rotate-half RoPE moves channel ``dim/2 - 1`` into the last one.

    ``scale`` (NVIDIA's ``dms_alpha_scale``, 100) multiplies the logit's learning rate; ``c``
    (their ``dms_initial_alpha_offset``, 5) makes a zeroed channel start at alpha ~ 0.0067.

    Args:
        query: ``[batch, q_heads, seq, dim]`` before RoPE.
        kv_heads: KV heads (query groups) of the layer.
    """
    return DMSChannels(query=zero_dms_channel(query, kv_heads),
                       alpha_logit=dms_alpha_logit(query, kv_heads, c, scale))


def dms_alpha_logit(query: torch.Tensor, kv_heads: int, c: float = 5.0,
                    scale: float = 100.0) -> torch.Tensor:
    """``alpha_logit [batch, kv_heads, seq] = q_g[..., -1] * scale - c`` of the first query head
    ``g`` of each KV group (see :func:`split_dms_channels`), the query left as it is."""
    dms_query_heads(query.shape[1], kv_heads)  # validates the grouping
    # a strided view, not an index list: no host-to-device copy (CUDA-graph capture refuses one)
    return query[:, ::query.shape[1] // kv_heads, :, DECISION_CHANNEL] * scale - c


def zero_dms_channel(query: torch.Tensor, kv_heads: int, scale: float = 0.0) -> torch.Tensor:
    """``query [batch, q_heads, seq, dim]`` with the DMS-borrowed channels (the last channel of
    the first query head of each KV group) multiplied by ``scale`` (0: zeroed; the zero-out
    phase's ``1 - t / n_t``, Eq. 12 of the DMC paper), out of place and differentiable."""
    batch, q_heads, seq, dim = query.shape
    dms_query_heads(q_heads, kv_heads)  # validates the grouping
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, seq, dim)
    first = scale_decision_channel(grouped[:, :, :1], scale)
    return torch.cat([first, grouped[:, :, 1:]], dim=2).reshape(query.shape)


def scale_decision_channel(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Returns ``x`` with its last channel multiplied by ``scale`` (out of place,
    differentiable): the zero-out phase's ``q[..., -1] * (1 - t / n_t)`` (Eq. 12).

    ``scale`` 0 (:func:`zero_decision_channel`, three times a DMC layer in training) is a product
    with a ``[1, ..., 1, 0]`` mask in ``x``'s dtype: one pass over ``x`` forward and one over its
    gradient, where the ``cat`` of two slices also filled and copied the gradient of each slice
    (an H200 train step spent ~24 ms of its 60 ms excess over vanilla in ``cat`` calls and
    copies); the same values (``x * 1`` and ``x * 0`` either way). Other scales keep the
    ``cat``: the product there rounds ``scale`` to a bf16 ``x``'s dtype first."""
    if scale == 0.0:
        keep = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        keep[-1:].zero_()  # in place on the device: no host value copied in (CUDA graphs)
        return x * keep
    return torch.cat([x[..., :-1], x[..., -1:] * scale], dim=-1)


def zero_decision_channel(x: torch.Tensor) -> torch.Tensor:
    """Returns ``x`` with its last channel set to 0 (out of place, differentiable)."""
    return scale_decision_channel(x, 0.0)


def without_decision_channel(cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables ``[..., head_dim]`` (:func:`dmc.ops.rope.rotate`'s) whose rotation of
    ``x`` is that of ``x`` with its decision channel zeroed, zeroed again after: the rotation
    with the channel out of it before and after RoPE (Sec. 3.1; NVIDIA's code zeroes both), in
    one pass over ``x`` each way instead of three. Zeroed entries: the output's last channel
    (``cos[-1]``, ``sin[-1]``) and ``sin[d/2 - 1]``, which rotate-half multiplies by the
    input's last channel. Equal to the three passes up to the sign of a zero."""
    dim = cos.shape[-1]
    keep_cos = torch.ones(dim, dtype=cos.dtype, device=cos.device)
    keep_cos[-1:].zero_()  # in place on the device: no host value copied in (CUDA graphs)
    keep_sin = keep_cos.clone()
    keep_sin[dim // 2 - 1:dim // 2].zero_()
    return cos * keep_cos, sin * keep_sin
