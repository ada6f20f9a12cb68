"""Slow, obviously-correct float64 references for tests only.

Each function loops over tokens and heads in plain Python so that its correctness can be read
off the paper: Eq. 9 (partial accumulation), App. H (mask), Algorithm 1 (inference with a
compressed cache), Eq. 10 (the CR loss, per sequence; App. G's local prior).
"""
from __future__ import annotations

import math

import torch


def partial_accumulate_reference(k, v, alpha, omega, window=None):
    """Eq. 9 term by term (differentiable): ``k~_i = sum_m c_{i,m} k_m / sum_m c_{i,m}`` with
    ``c_{i,m} = omega_m prod_{l=m+1..i} alpha_l`` over m in (i - window, i] (all m <= i when
    ``window`` is None). Shapes as :func:`dmc.ops.partial_accumulate`; returns float64."""
    k, v, alpha, omega = (t.double() for t in (k, v, alpha, omega))
    batch, heads, seq, _ = k.shape
    k_rows, v_rows = [], []
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                first = 0 if window is None else max(0, i - window + 1)
                z, k_sum, v_sum = 0.0, 0.0, 0.0
                for m in range(first, i + 1):
                    coeff = omega[b, h, m]
                    for l in range(m + 1, i + 1):
                        coeff = coeff * alpha[b, h, l]
                    z += coeff
                    k_sum = k_sum + coeff * k[b, h, m]
                    v_sum = v_sum + coeff * v[b, h, m]
                k_rows.append(k_sum / z)
                v_rows.append(v_sum / z)
    shape = k.shape
    return torch.stack(k_rows).reshape(shape), torch.stack(v_rows).reshape(shape)


def attention_bias_reference(alpha):
    """App. H entry by entry: ``[batch, heads, seq, seq]`` float64."""
    alpha = alpha.double()
    batch, heads, seq = alpha.shape
    bias = torch.empty(batch, heads, seq, seq, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                for j in range(seq):
                    if j > i:
                        bias[b, h, i, j] = -math.inf
                    elif j == i:
                        bias[b, h, i, j] = 0.0
                    else:
                        keep = 1.0 - alpha[b, h, j + 1].item()
                        bias[b, h, i, j] = math.log(keep) if keep > 0 else -math.inf
    return bias


def dms_attention_bias_reference(alpha, window):
    """The DMS delayed-eviction mask entry by entry: ``[batch, heads, seq, seq]`` float64;
    key j is seen unweighted by queries j..j+window and weighted by 1 - alpha[j + 1] after."""
    alpha = alpha.double()
    batch, heads, seq = alpha.shape
    bias = torch.empty(batch, heads, seq, seq, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                for j in range(seq):
                    if j > i:
                        bias[b, h, i, j] = -math.inf
                    elif i - j <= window or j + 1 >= seq:
                        bias[b, h, i, j] = 0.0
                    else:
                        keep = 1.0 - alpha[b, h, j + 1].item()
                        bias[b, h, i, j] = math.log(keep) if keep > 0 else -math.inf
    return bias


def compressed_cache_reference(k, v, alpha, omega):
    """Algorithm 1 with hard decisions, exact (unwindowed) merging.

    Args:
        k, v: ``[seq, dim]`` for one head; alpha: ``[seq]`` in {0, 1}; omega: ``[seq]``.

    Returns:
        ``(keys, values, slot_of_token)``: the cache after every token as lists of float64
        ``[slots, dim]`` tensors (entry t is the cache after token t) and, per token, the index
        of the slot it was written to.
    """
    keys, values, weights = [], [], []
    history_k, history_v, slot_of_token = [], [], []
    for t in range(k.shape[0]):
        kt, vt, wt = k[t].double(), v[t].double(), float(omega[t])
        if t == 0 or alpha[t] < 0.5:
            keys.append(kt)
            values.append(vt)
            weights.append(wt)
        else:
            z = weights[-1] + wt
            keys[-1] = (weights[-1] * keys[-1] + wt * kt) / z
            values[-1] = (weights[-1] * values[-1] + wt * vt) / z
            weights[-1] = z
        slot_of_token.append(len(keys) - 1)
        history_k.append(torch.stack(keys))
        history_v.append(torch.stack(values))
    return history_k, history_v, slot_of_token


def compression_loss_reference(alpha, target_cr, prior="global", head_cr_cap=None,
                               head_balance_weight=0.0):
    """Eq. 10 with Python sums, sequence by sequence, ``alpha [batch, layers, heads, seq]``.

    global: ``loss_b = max(0, sum_{l,h,t} (1 - alpha) - n_l n_h n / CR) / (n_l n_h n)``;
    local (App. G): ``loss_b = sum_l max(0, sum_{h,t} (1 - alpha) - n_h n / CR) / (n_l n_h n)``;
    the per-head cap adds ``sum_{l,h} max(0, n / cap - sum_t (1 - alpha)) / (n_l n_h n)``;
    DMC-C (App. E, Eq. 13 with the mean over heads) adds ``weight * sum_{l,h,t} |alpha_lht -
    mean_h' alpha_lh't| / (n_l n_h n)``.
    Returns the mean of ``loss_b`` over the batch as a Python float.
    """
    alpha = alpha.double()
    batch, layers, heads, seq = alpha.shape
    total = layers * heads * seq
    losses = []
    for b in range(batch):
        kept_per_layer, cap_hinge, balance = [], 0.0, 0.0
        for layer in range(layers):
            kept = 0.0
            for h in range(heads):
                head_kept = 0.0
                for t in range(seq):
                    head_kept += 1.0 - alpha[b, layer, h, t].item()
                    mean = sum(alpha[b, layer, g, t].item() for g in range(heads)) / heads
                    balance += abs(alpha[b, layer, h, t].item() - mean) / total
                kept += head_kept
                if head_cr_cap is not None:
                    cap_hinge += max(0.0, seq / head_cr_cap - head_kept) / total
            kept_per_layer.append(kept)
        if prior == "global":
            loss = max(0.0, sum(kept_per_layer) - total / target_cr) / total
        else:
            per_layer = heads * seq
            loss = sum(max(0.0, k - per_layer / target_cr) for k in kept_per_layer) / total
        losses.append(loss + cap_hinge + head_balance_weight * balance)
    return sum(losses) / batch


def delayed_merge_attention_reference(q, k, v, alpha, omega, delay, inv_freq):
    """DMC with delayed merging for one head, query by query, from Algorithm 1: query i (RoPE at
    i) attends to the slots :func:`compressed_cache_reference` leaves after tokens 0 .. i - d - 1
    (each slot's mean key rotated at the position of its last token, as the engine's open slot
    is) and to tokens max(0, i - d) .. i as they are (rotated at their own positions).

    Args:
        q, k, v: ``[seq, dim]`` pre-RoPE; alpha: ``[seq]`` in {0, 1}; omega: ``[seq]``;
        delay: d >= 1; inv_freq: ``[dim // 2]``.

    Returns:
        ``[seq, dim]`` float64.
    """
    from dmc.ops.rope import apply_rope

    inv_freq = inv_freq.double()
    rows = []
    for i in range(q.shape[0]):
        keys, values = [], []
        merged = i - delay
        if merged > 0:
            slot_keys, slot_values, slot_of = compressed_cache_reference(
                k[:merged], v[:merged], alpha[:merged], omega[:merged])
            for slot in range(slot_keys[-1].shape[0]):
                last = max(t for t in range(merged) if slot_of[t] == slot)
                keys.append(apply_rope(slot_keys[-1][slot], torch.tensor(last), inv_freq))
                values.append(slot_values[-1][slot])
        for j in range(max(0, merged), i + 1):
            keys.append(apply_rope(k[j].double(), torch.tensor(j), inv_freq))
            values.append(v[j].double())
        query = apply_rope(q[i].double(), torch.tensor(i), inv_freq)
        scores = torch.stack(keys) @ query / math.sqrt(q.shape[-1])
        rows.append(scores.softmax(0) @ torch.stack(values))
    return torch.stack(rows)
