"""The decode write of DMC with delayed merging (``DelayedMergeCache.write``): the compiled CPU
kernel, the PyTorch path and static steps (device positions, no host branch) leave the same
cache, across ring wrap-arounds, page boundaries, appends and merges; the end-to-end semantics
(against the eval-mode forward) are tested in test_delayed_engine.py."""
import pytest
import torch

from dmc.inference.delayed_cache import DelayedMergeCache
from dmc.inference.kernels.native import load_library

DIM, PAGE, LAYERS = 16, 3, 2
EXACT = ("block_tables", "lengths", "open_count", "written", "ring_alpha", "ring_omega")
CLOSE = ("k_pages", "v_pages", "open_k", "open_v", "open_omega", "ring_k", "ring_v")


@pytest.mark.parametrize("delay,window,dtype", [(1, 3, torch.float32), (4, 2, torch.bfloat16),
                                                (6, 12, torch.float32)])
def test_compiled_decode_write_equals_the_pytorch_path(delay, window, dtype):
    """Random batches of sequences (varying subsets, slot order shuffled) decode through four
    caches, writing with the compiled kernel or the PyTorch path, with ordinary steps or with
    static ones once every ring of the batch is full: lengths, block tables, token counts and
    decisions stay equal, keys, values and merge state equal to float rounding (exactly, between
    caches of one path)."""
    if load_library() is None:
        pytest.skip("no C compiler: the compiled kernel is not built")
    gen = torch.Generator().manual_seed(delay)
    kv, seqs, steps = 2, 3, 3 * (delay + 1) + 4 * PAGE + 5
    caches = [DelayedMergeCache(LAYERS, kv, DIM, 300, delay, page_size=PAGE, max_seqs=seqs,
                                window=window, dtype=dtype) for _ in range(4)]
    caches[1].native_kernels = caches[3].native_kernels = False
    slots = [[c.add_sequence() for _ in range(seqs)] for c in caches][0]
    static_steps, merged = 0, 0
    for step in range(steps):
        batch = [slots[i] for i in torch.randperm(seqs, generator=gen)[:1 + step % seqs]]
        positions = caches[2].written[batch, 0].clone()
        static = bool((positions > delay).all())
        static_steps += static
        for i, cache in enumerate(caches):
            cache.begin_decode(batch, static=static and i >= 2)
        for layer in range(LAYERS):
            keys, values = torch.randn(2, len(batch), kv, DIM, generator=gen)
            alpha = (torch.rand(len(batch), kv, generator=gen) < 0.5).float()
            omega = torch.rand(len(batch), kv, generator=gen) + 0.1
            for cache in caches:
                cache.write(layer, batch, positions, keys, values, omega, alpha, defer=True)
        for cache in caches:
            cache.settle()
        for name in EXACT:
            for other in caches[1:]:
                assert torch.equal(getattr(caches[0], name), getattr(other, name)), (step, name)
        for name in CLOSE:
            assert torch.equal(getattr(caches[0], name), getattr(caches[2], name)), (step, name)
            assert torch.equal(getattr(caches[1], name), getattr(caches[3], name)), (step, name)
            for other in caches[1:]:
                torch.testing.assert_close(getattr(other, name).float(),
                                           getattr(caches[0], name).float(), atol=2e-5,
                                           rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                           msg=lambda m: f"step {step}, {name}: {m}")
        merged = int((caches[0].written[slots] - delay - 1).clamp(min=0).sum()) * kv \
            - int(caches[0].lengths[slots].sum())
    assert len({cache.pages_in_use for cache in caches}) == 1 and caches[0].pages_in_use > 0
    assert static_steps > 3 and merged > 10, "steps should go static and tokens merge"
    for cache in caches:
        for slot in slots:
            cache.free_sequence(slot)
        assert cache.pages_in_use == 0
