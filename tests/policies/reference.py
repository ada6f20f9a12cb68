"""Float64 references of the KV policies, written from their papers, for tests only.

One layer of ``kv`` KV heads with ``group`` query heads each, one sequence, plain Python lists.
:func:`run` feeds a prompt of ``prompt`` tokens at once, then the other tokens one at a time;
after each step the policy brings each head down to its budget. It returns, per step, the kept
token positions of every head and the scores the policy ranked them by.

Inputs: ``q [heads, T, d]`` and ``k [kv, T, d]`` post-RoPE at the original positions, ``v``.
"""
from __future__ import annotations

import math

import torch

NEG = float("-inf")


def softmax(x):
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.softmax(x, dim=-1)


def attention(q, keys, scale):
    """softmax(q . k_j * scale) over the given keys ``[n, d]``."""
    return softmax(keys @ q * scale)


def budget(tokens, cr):
    return max(1, math.ceil(tokens / cr))


def ranked(candidates, score, count):
    """The ``count`` best candidates (ties: lower position first)."""
    return sorted(sorted(candidates, key=lambda j: (-score[j], j))[:count])


class Head:
    """Kept positions (in order) and the current key / value of each."""

    def __init__(self):
        self.kept, self.key, self.value = [], {}, {}

    def keys(self, positions=None):
        return torch.stack([self.key[j] for j in (positions or self.kept)])


def run(name, q, k, v, prompt, cr, scale, budgets=None, **kw):
    """``budgets(n)``: the slots per head after ``n`` tokens (default ``ceil(n / cr)``)."""
    heads, total, _ = q.shape
    kv = k.shape[0]
    group = heads // kv
    state = [Head() for _ in range(kv)]
    extra = {"acc": [dict() for _ in range(kv)], "tau": [None] * kv}
    steps = []
    for end in [prompt] + list(range(prompt + 1, total + 1)):
        start = 0 if end == prompt else end - 1
        for h in range(kv):
            for t in range(start, end):
                state[h].kept.append(t)
                state[h].key[t], state[h].value[t] = k[h, t].double(), v[h, t].double()
        b = budgets(end) if budgets else budget(end, cr)
        # attention of the new queries over what each head holds (causal by position)
        probs = {}
        for h in range(kv):
            for g in range(group):
                for i in range(start, end):
                    visible = [j for j in state[h].kept if j <= i]
                    p = attention(q[h * group + g, i].double(), state[h].keys(visible), scale)
                    probs[h, g, i] = dict(zip(visible, p.tolist()))
        step_scores, joint = [], []
        if name == "tova":
            last = end - 1
            score = {j: sum(probs[h, g, last].get(j, 0.0) for h in range(kv)
                            for g in range(group)) / heads for j in state[0].kept}
        for h in range(kv):
            head = state[h]
            if name in ("h2o", "d2o", "caote-h2o"):
                acc = extra["acc"][h]
                for (hh, g, i), p in probs.items():
                    if hh == h:
                        for j, x in p.items():
                            acc[j] = acc.get(j, 0.0) + x
                score = dict(acc)
            elif name == "snapkv":
                score = snapkv_scores(q, head, h, group, end, b, scale, kw["window"],
                                      kw["kernel_size"])
            elif name == "knorm":  # Devoto et al.: the lowest key norms
                score = {j: -float(head.key[j].norm()) for j in head.kept}
            elif name == "keydiff":  # Park et al.: -cos(mean unit key, k_j)
                anchor = torch.stack([head.key[j] / head.key[j].norm() for j in head.kept]).mean(0)
                score = {j: -float(torch.nn.functional.cosine_similarity(head.key[j], anchor,
                                                                          dim=0))
                         for j in head.kept}
            elif name == "caote-tova":  # TOVA per KV head: its own query group's last query
                score = {j: sum(probs[h, g, end - 1].get(j, 0.0) for g in range(group)) / group
                         for j in head.kept}
            elif name != "tova":
                raise ValueError(name)
            if name in ("caote-h2o", "caote-tova"):
                score = caote_scores(head, score, fast=kw.get("fast", False))
            step_scores.append({j: score[j] for j in head.kept})
            if len(head.kept) <= b and "safeguard" not in kw:
                continue
            if name in ("h2o", "caote-h2o"):
                recent = head.kept[len(head.kept) - (b - b // 2):]
                guard = recent
            elif name == "d2o":  # b = T + N + M, N:M = 3:1 (Eq. 7, App. A.3)
                sinks = min(kw["sinks"], b)
                recent = math.ceil((b - sinks) / 4)
                guard = head.kept[:sinks] + head.kept[len(head.kept) - recent:]
            elif name == "snapkv":
                guard = head.kept[len(head.kept) - min(kw["window"], b):]
            else:
                guard = []
            others = [j for j in head.kept if j not in guard]
            if "safeguard" in kw:
                joint.append((guard, others, score))
                continue
            keep = sorted(set(guard) | set(ranked(others, score, b - len(guard))))
            if name == "d2o":
                d2o_merge(head, keep, extra["tau"], h, kw["beta"])
            head.kept = keep
        if joint:
            adakv_evict(state, joint, b, kw["safeguard"])
        steps.append(([list(s.kept) for s in state], step_scores))
    return steps


def adakv_evict(state, joint, b, safeguard):
    """Ada-KV Alg. 1 with its safeguard: every head keeps its guard and its best up to
    ``floor(safeguard b)``; the layer's other ``kv b`` slots go to the best scores over all heads
    (ties: lower head, then lower position)."""
    floor = math.floor(safeguard * b)
    keeps = [set(guard) | set(ranked(others, score, max(0, floor - len(guard))))
             for guard, others, score in joint]
    pool = sorted((-score[j], h, j) for h, (_, others, score) in enumerate(joint)
                  for j in others if j not in keeps[h])
    for _, h, j in pool[:max(0, len(joint) * b - sum(map(len, keeps)))]:
        keeps[h].add(j)
    for head, keep in zip(state, keeps):
        head.kept = sorted(keep)


def snapkv_scores(q, head, h, group, end, b, scale, window, kernel_size):
    """SnapKV Eq. 1-2: the last ``min(window, b)`` queries' attention (softmax over every visible
    held key), summed over the window, averaged over the group, average-pooled over the prefix."""
    w = min(window, b)
    votes = {j: 0.0 for j in head.kept}
    for g in range(group):
        for i in range(end - w, end):
            visible = [j for j in head.kept if j <= i]
            p = attention(q[h * group + g, i].double(), head.keys(visible), scale)
            for j, x in zip(visible, p.tolist()):
                votes[j] += x / group
    prefix = head.kept[:len(head.kept) - w]
    pad = kernel_size // 2
    pooled = {}
    for idx, j in enumerate(prefix):
        around = [prefix[o] for o in range(idx - pad, idx + pad + 1) if 0 <= o < len(prefix)]
        pooled[j] = sum(votes[x] for x in around) / kernel_size
    for j in head.kept[len(prefix):]:
        pooled[j] = 0.0
    return pooled


def caote_scores(head, score, fast=False):
    """CAOTE Eq. 8: ``alpha_j / (1 - alpha_j) ||o - v_j||`` with ``alpha`` the normalised
    scores and ``o = sum alpha_i v_i`` (FastCAOTE: ``o`` = the mean value)."""
    total = sum(score[j] for j in head.kept)
    alpha = {j: score[j] / total for j in head.kept}
    values = torch.stack([head.value[j] for j in head.kept])
    if fast:
        o = values.mean(0)
    else:
        o = sum(alpha[j] * head.value[j] for j in head.kept)
    return {j: alpha[j] / (1 - alpha[j]) * float((o - head.value[j]).norm())
            for j in head.kept}


def d2o_merge(head, keep, tau, h, beta):
    """D2O Sec. 4.2.2: evicted keys go to their most cosine-similar kept key when the similarity
    reaches the EMA threshold (Eq. 10: ``tau = beta u + (1 - beta) tau``); similarity-weighted
    average of keys and values (Eq. 11-12)."""
    evicted = [j for j in head.kept if j not in keep]
    best = {}
    for e in evicted:
        sims = {r: float(torch.nn.functional.cosine_similarity(head.key[e], head.key[r], dim=0))
                for r in keep}
        target = max(keep, key=lambda r: (sims[r], -r))
        best[e] = (sims[target], target)
    mean = sum(s for s, _ in best.values()) / len(best)
    tau[h] = mean if tau[h] is None else beta * mean + (1 - beta) * tau[h]
    groups = {r: [] for r in keep}
    for e, (s, r) in best.items():
        if s >= tau[h]:
            groups[r].append((math.exp(s), e))
    for r, members in groups.items():
        if not members:
            continue
        weight = math.e + sum(w for w, _ in members)
        for table in (head.key, head.value):
            table[r] = (math.e * table[r] + sum(w * table[e] for w, e in members)) / weight


def pyramid_budgets(layers, per_head, beta, alpha):
    """PyramidKV Sec. 4.2.1 budgets (real-valued): ``alpha`` in every layer plus Eq. 1's
    arithmetic sequence over the remaining ``layers (per_head - alpha)``; ``per_head`` in every
    layer when nothing remains."""
    total = layers * (per_head - alpha)
    if total <= 0:
        return [float(per_head)] * layers
    top = total / (beta * layers)
    bottom = 2 * total / layers - top
    return [alpha + bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]


def d2o_layer_shares(q, k, prompt, scale):
    """D2O Eq. 4-5 over ``q [layers, heads, T, d]``, ``k [layers, kv, T, d]``: per query head the
    population variance of the column sums of its causal prompt attention, averaged over the
    heads (``F_v^l``), divided by the mean over layers (the stated normalisation), then
    ``softmax(-F)``."""
    layers, heads = q.shape[:2]
    group = heads // k.shape[1]
    variance = []
    for layer in range(layers):
        per_head = []
        for head in range(heads):
            columns = [0.0] * prompt
            for i in range(prompt):
                p = attention(q[layer, head, i].double(), k[layer, head // group, :i + 1].double(),
                              scale)
                for j in range(i + 1):
                    columns[j] += float(p[j])
            mean = sum(columns) / prompt
            per_head.append(sum((c - mean) ** 2 for c in columns) / prompt)
        variance.append(sum(per_head) / heads)
    scale_f = sum(variance) / layers
    weights = [math.exp(-f / scale_f) for f in variance]
    return [w / sum(weights) for w in weights], variance


def omnikv_selection(q, k, n, count, scale, window=16, selector="exponential"):
    """OmniKV Eq. 3-4 at a decode step after ``n`` tokens: the window's queries (the last
    ``window``) attend causally to ``k [kv, T, d]``; ``S_t = sum_j alpha_j max_h A[h, j, t]``;
    the top ``count`` earlier positions (ties: lower first) plus the current token ``n - 1``."""
    heads = q.shape[0]
    group = heads // k.shape[0]
    first = max(0, n - window)
    score = [0.0] * n
    for i in range(first, n):
        slot = i - (n - window)  # oldest query at slot 0 of a full window
        alpha = 2.0 ** (slot - window) if selector == "exponential" else 1.0
        if selector == "last" and i != n - 1:
            continue
        top = [0.0] * (i + 1)
        for h in range(heads):
            p = attention(q[h, i].double(), k[h // group, :i + 1].double(), scale)
            top = [max(a, float(b)) for a, b in zip(top, p)]
        for t, x in enumerate(top):
            score[t] += alpha * x
    return ranked(range(n - 1), score, count) + [n - 1]
