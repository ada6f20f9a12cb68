"""Drive a policy through PolicyRunner on a real float64 PagedKVCache, without a model: random
post-RoPE queries, keys and values of ``TOTAL`` tokens, a prompt (in chunks or not), then one
token at a time."""
import torch

from dmc.inference import PagedKVCache
from dmc.inference.kernels import apply_rope, rope_inv_freq
from dmc.policies import PolicyRunner

KV, GROUP, DIM, TOTAL, PROMPT = 2, 2, 8, 26, 15
SCALE = DIM ** -0.5


def inputs(seed, layers=1, total=TOTAL):
    """Post-RoPE queries ``[layers, heads, T, d]``, keys and values ``[layers, kv, T, d]``."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(total)
    inv_freq = rope_inv_freq(DIM)
    q = apply_rope(torch.randn(layers, KV * GROUP, total, DIM, generator=gen) * 1.5, positions,
                   inv_freq)
    k = apply_rope(torch.randn(layers, KV, total, DIM, generator=gen), positions, inv_freq)
    v = torch.randn(layers, KV, total, DIM, generator=gen)
    return q, k, v


def drive(policy, q, k, v, prompt=PROMPT, chunk=None, dtype=torch.float64, device="cpu"):
    """The prompt in chunks of ``chunk`` tokens (None: one chunk), then single tokens; returns
    (kept positions per layer and head, scores per layer, cache) after the prompt's last chunk
    and after each decode step, the scores taken just before the runner's eviction hook (none
    for a policy that does not evict). ``device``: where the cache, the runner and the policy
    work (the scores come back on it)."""
    layers, total = q.shape[0], q.shape[2]
    q, k, v = q.to(device), k.to(device), v.to(device)
    cache = PagedKVCache(layers, KV, DIM, num_pages=4 * total, page_size=4, max_seqs=4,
                         window=None, dtype=dtype, max_seq_len=total + 4, device=device)
    runner = PolicyRunner(policy, cache, KV * GROUP, SCALE)
    seq = cache.add_sequence()
    runner.reset(seq)
    chunk = chunk or prompt
    spans = [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)]
    spans += [(end - 1, end) for end in range(prompt + 1, total + 1)]
    out = []
    for start, end in spans:
        prefill = end <= prompt
        for layer in range(layers):
            n = end - start
            cache.pack_prefill(layer, seq, k[layer, :, start:end], v[layer, :, start:end],
                               torch.full((KV,), n), torch.zeros(KV, 1, DIM, device=device),
                               torch.zeros(KV, 1, DIM, device=device),
                               torch.zeros(KV, 1, device=device), torch.zeros(KV))
            runner.observe(layer, [seq], q[layer, :, start:end][None],
                           torch.arange(start, end)[None], prefill=prefill)
        budgets = policy.budgets(torch.tensor([seq]), torch.tensor([end], device=device))
        scores = []
        for layer in range(layers if policy.evicts else 0):
            view = runner.view(layer, torch.tensor([seq]), torch.tensor([end]))
            scores.append(policy.scores(view, budgets[:, layer])[0])
        runner.evict([seq], [end], decode=not prefill, prompt_end=end == prompt)
        if prefill and end < prompt:
            continue
        kept = [[runner.positions[seq, layer, h, :int(cache.lengths[seq, layer, h])].tolist()
                 for h in range(KV)] for layer in range(layers)]
        out.append((kept, scores, cache))
    return out
