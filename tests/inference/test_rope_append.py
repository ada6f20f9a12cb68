"""The Triton vanilla decode write (the interpreter on CPU): keys and queries rotated, keys and
values stored in their reserved slots, in one launch, against the PyTorch path it replaces
(:func:`dmc.ops.rope.rotate`, then an indexed store of each pool); a reserved entry outside the
pool is skipped and counted."""
import pytest
import torch

from dmc.inference.kernels import run_rope_append
from dmc.inference.kernels.faults import fault_counter
from dmc.ops.rope import rotate

from test_decode_rope import step_rows

LAYERS, PAGES, PAGE_SIZE = 3, 16, 4


def reserved_slots(batch, kv_heads, seed=0):
    """``(pages, offsets) [batch, LAYERS, kv_heads]`` int32: distinct slots of the pool."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randperm(PAGES * PAGE_SIZE, generator=gen)[:batch * LAYERS * kv_heads]
    flat = flat.view(batch, LAYERS, kv_heads).to(torch.int32)
    return flat // PAGE_SIZE, flat % PAGE_SIZE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(4, 4, 16), (8, 2, 16), (6, 2, 10)])
def test_rope_append_matches_the_pytorch_path(dtype, q_heads, kv_heads, dim):
    batch, layer = 5, 1
    q, positions, cos, sin = step_rows(batch, q_heads, dim, dtype, seed=1)
    k, _, _, _ = step_rows(batch, kv_heads, dim, dtype, seed=2)
    v = torch.randn(batch, kv_heads, dim).to(dtype)
    pages, offsets = reserved_slots(batch, kv_heads)
    pools = [torch.randn(PAGES, PAGE_SIZE, dim).to(dtype) for _ in range(2)]
    want = [pool.clone() for pool in pools]
    page, offset = pages[:, layer].long(), offsets[:, layer].long()
    want[0][page, offset] = rotate(k.float(), cos, sin).to(dtype)
    want[1][page, offset] = v
    faults = fault_counter("cpu")
    got_q = run_rope_append(q, k, v, cos, sin, *pools, pages[:, layer], offsets[:, layer],
                            torch.arange(batch), layer, LAYERS, faults=faults)
    torch.testing.assert_close(got_q, rotate(q.float(), cos, sin), rtol=1e-6, atol=1e-6)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1 / 128, atol=1e-6)
    torch.testing.assert_close(pools[0], want[0], **tol)  # bf16: the interpreter truncates
    torch.testing.assert_close(pools[1], want[1], rtol=0, atol=0)
    assert faults.tolist() == [0, -1]


def test_an_entry_outside_the_pool_is_skipped_and_located():
    batch, kv_heads, dim, layer = 3, 2, 8, 2
    q, _, cos, sin = step_rows(batch, 4, dim, torch.float32)
    k, _, _, _ = step_rows(batch, kv_heads, dim, torch.float32, seed=3)
    v = torch.randn(batch, kv_heads, dim)
    pages, offsets = reserved_slots(batch, kv_heads)
    pages[1, layer, 0] = -1  # never reserved
    pools = [torch.zeros(PAGES, PAGE_SIZE, dim) for _ in range(2)]
    faults = fault_counter("cpu")
    rows = torch.tensor([7, 4, 9])
    run_rope_append(q, k, v, cos, sin, *pools, pages[:, layer], offsets[:, layer], rows, layer,
                    LAYERS, faults=faults)
    assert faults.tolist() == [1, (4 * LAYERS + layer) * kv_heads + 0]
    written = (pools[1] != 0).any(-1).sum()
    assert int(written) == batch * kv_heads - 1  # every other head's value, none outside
