"""DMS decode attention: the padded-gather path (any device), the Triton path (the paged kernel
with the ring folded into its reduce step; the interpreter on the CPU) and the CPU path (batched
paged kernel merged with the ring by log-sum-exp) against a float64 loop over (sequence, query
head)."""
import pytest
import torch

from dmc.inference.kernels.dms_decode import dms_decode_attention, dms_decode_attention_cpu


def _case(batch, q_heads, kv_heads, ring, page_size=4, dim=8, max_len=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (batch, kv_heads), generator=gen)
    lengths[0, 0] = 0  # a head with no survivor: the ring alone
    max_pages = -(-max_len // page_size)
    num_pages = batch * kv_heads * max_pages + 3
    order = torch.randperm(num_pages, generator=gen)[:batch * kv_heads * max_pages]
    tables = order.reshape(batch, kv_heads, max_pages).int()
    tables[lengths == 0] = -1
    k_pages = torch.randn(num_pages, page_size, dim, generator=gen)
    v_pages = torch.randn(num_pages, page_size, dim, generator=gen)
    ring_k = torch.randn(batch, kv_heads, ring, dim, generator=gen)
    ring_v = torch.randn(batch, kv_heads, ring, dim, generator=gen)
    ring_count = torch.randint(1, ring + 1, (batch,), generator=gen)
    q = torch.randn(batch, q_heads, dim, generator=gen)
    return q, k_pages, v_pages, tables, lengths, ring_k, ring_v, ring_count


def _reference(q, k_pages, v_pages, tables, lengths, ring_k, ring_v, ring_count, scale):
    batch, q_heads, dim = q.shape
    kv_heads, page_size = tables.shape[1], k_pages.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            keys, values = [], []
            for slot in range(int(lengths[b, kv])):
                page = int(tables[b, kv, slot // page_size])
                keys.append(k_pages[page, slot % page_size])
                values.append(v_pages[page, slot % page_size])
            for row in range(int(ring_count[b])):
                keys.append(ring_k[b, kv, row])
                values.append(ring_v[b, kv, row])
            scores = torch.stack(keys).double() @ q[b, h].double() * scale
            out[b, h] = torch.softmax(scores, 0) @ torch.stack(values).double()
    return out


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "pytorch"])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("ring", [1, 5])
def test_every_path_equals_the_float64_loop(q_heads, kv_heads, ring, native):
    """The gathering path, and the CPU path compiled (pages and rings in place, the rings a
    pool addressed by index in shuffled order) or in PyTorch."""
    q, k_pages, v_pages, tables, lengths, ring_k, ring_v, count = _case(3, q_heads, kv_heads,
                                                                        ring)
    want = _reference(q, k_pages, v_pages, tables, lengths, ring_k, ring_v, count, 0.3)
    gathered = dms_decode_attention(q, k_pages, v_pages, tables, lengths.int(),
                                    int(lengths.max()) + 2, ring_k, ring_v, count, 0.3)
    torch.testing.assert_close(gathered.double(), want, atol=2e-5, rtol=0)
    order = torch.tensor([2, 0, 1])  # the pool holds the rings in another order, plus one more
    pool_k = torch.cat([ring_k[order], torch.full_like(ring_k[:1], float("nan"))])
    pool_v = torch.cat([ring_v[order], torch.full_like(ring_v[:1], float("nan"))])
    for b, n in enumerate(count.tolist()):  # rows past the filled ones are never read
        pool_k[torch.argsort(order)[b], :, n:] = float("nan")
        pool_v[torch.argsort(order)[b], :, n:] = float("nan")
    batched = dms_decode_attention_cpu(q, k_pages, v_pages, tables, lengths.int(), pool_k,
                                       pool_v, torch.argsort(order), count, 0.3, native=native)
    torch.testing.assert_close(batched.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
def test_triton_path_equals_the_float64_loop(q_heads, kv_heads, num_splits):
    """The Triton paged kernel over the survivors and, in its ring mode, the rings as one more
    part of its split-K, given per sequence or read in place from a shuffled pool; ring rows
    past the filled ones hold NaN and are never used (the PyTorch path gathers the pool)."""
    q, k_pages, v_pages, tables, lengths, ring_k, ring_v, count = _case(3, q_heads, kv_heads, 5,
                                                                        seed=2)
    want = _reference(q, k_pages, v_pages, tables, lengths, ring_k, ring_v, count, 0.3)
    for b, n in enumerate(count.tolist()):
        ring_k[b, :, n:] = float("nan")
        ring_v[b, :, n:] = float("nan")
    got = dms_decode_attention(q, k_pages, v_pages, tables, lengths.int(),
                               int(lengths.max()) + 2, ring_k, ring_v, count, 0.3,
                               use_triton=True, num_splits=num_splits)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    order = torch.tensor([2, 0, 1])  # rings read in place from a shuffled pool of 4 (ring_rows)
    pool_k = torch.cat([ring_k[order], torch.full_like(ring_k[:1], float("nan"))])
    pool_v = torch.cat([ring_v[order], torch.full_like(ring_v[:1], float("nan"))])
    for path in (True, False):
        got = dms_decode_attention(q, k_pages, v_pages, tables, lengths.int(),
                                   int(lengths.max()) + 2, pool_k, pool_v, count, 0.3,
                                   ring_rows=torch.argsort(order), use_triton=path,
                                   num_splits=num_splits)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
