"""The decode write of DMC with delayed merging (``DelayedMergeCache.write``): the compiled CPU
kernel, the Triton kernel (the interpreter) and the PyTorch path, with ordinary and static steps
(device positions, no host branch), leave the same cache, across ring wrap-arounds, page
boundaries, appends and merges; the end-to-end semantics (against the eval-mode forward) are
tested in test_delayed_engine.py."""
import pytest
import torch

from dmc.inference.delayed_cache import DelayedMergeCache
from dmc.inference.kernels import DecisionChannel, run_decode_rope
from dmc.inference.kernels.native import load_library
from dmc.ops.algorithm1 import KeyDecision
from dmc.ops.rope import rope_tables

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
    caches = [DelayedMergeCache(LAYERS, 2, DIM, 300, delay, page_size=PAGE, max_seqs=3,
                                window=window, dtype=dtype) for _ in range(4)]
    caches[1].native_kernels = caches[3].native_kernels = False

    def write(caches, layer, batch, positions, keys, values, omega, alpha):
        for cache in caches:
            cache.write(layer, batch, positions, keys, values, omega, alpha, defer=True)

    decode_and_compare(caches, delay, dtype, write, static_from=2, pairs=((0, 2), (1, 3)))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("delay,window,dtype,groups", [
    (2, None, torch.bfloat16, 2), pytest.param(1, 3, torch.float32, 1, marks=pytest.mark.slow),
    pytest.param(6, None, torch.float32, 3, marks=pytest.mark.slow),
    pytest.param(3, 12, torch.bfloat16, 1, marks=pytest.mark.slow)])
def test_triton_decode_write_equals_the_pytorch_path(delay, window, dtype, groups, device):
    """The Triton write (one launch: the decision read from the key, the leaving token through
    Algorithm 1, the token into the ring), with ordinary and static steps, against the PyTorch
    path; with ``groups`` query heads per KV head it also reads the importance from the
    queries and rotates them, equal to the decode RoPE kernel's, which gives the PyTorch
    path its importance (the interpreter on the CPU, compiled on CUDA)."""
    caches = [DelayedMergeCache(LAYERS, 2, DIM, 300, delay, page_size=PAGE, max_seqs=3,
                                window=window, dtype=dtype, device=device) for _ in range(3)]
    caches[0].native_kernels = False
    decision = KeyDecision(0.3)
    channel = DecisionChannel(2, 0.5, 2.0 ** -7)

    def write(caches, layer, batch, positions, keys, values, omega, alpha):
        keys[..., -1] = torch.where(alpha > 0.5, 1.0, -0.5)  # alpha = [k[-1] - 0.3 > 0]
        gen = torch.Generator().manual_seed(int(positions.sum()) * LAYERS + layer)
        queries = torch.randn(len(batch), 2 * groups, DIM, generator=gen).to(device, dtype)
        keys, values, positions = keys.to(device, dtype), values.to(device), positions.to(device)
        cos, sin = rope_tables(positions[:, None], caches[0].inv_freq)
        rotated, omega = run_decode_rope(queries, cos, sin, channel)
        caches[0].write(layer, batch, positions, keys, values, omega, decision,
                        use_triton=False, defer=True)
        for cache in caches[1:]:
            out = cache.write(layer, batch, positions, keys, values, None, decision,
                              use_triton=True, defer=True, query=(queries, cos, sin, channel))
            assert torch.equal(out, rotated)

    # bf16: the interpreter's casts truncate where PyTorch's round, an ulp (2^-6 at |x| < 4)
    decode_and_compare(caches, delay, dtype, write, static_from=2, pairs=((1, 2),),
                       bf16_atol=2.0 ** -6)


def decode_and_compare(caches, delay, dtype, write, static_from, pairs, bf16_atol=2e-5):
    """Random batches of sequences (varying subsets, slot order shuffled) decode through
    ``caches``, all written by ``write(caches, layer, batch, positions, keys, values, omega,
    alpha)``, those from ``static_from`` on with static steps once every ring of the batch is
    full: lengths, block tables, token counts and decisions stay equal, keys, values and merge
    state equal to float rounding (``bf16_atol`` in bfloat16; bit for bit within each of
    ``pairs``)."""
    gen = torch.Generator().manual_seed(delay)
    kv, seqs, steps = caches[0].num_kv_heads, caches[0].max_seqs, 3 * (delay + 1) + 4 * PAGE + 5
    slots = [[c.add_sequence() for _ in range(seqs)] for c in caches][0]
    static_steps, merged = 0, 0
    for step in range(steps):
        batch = [slots[i] for i in torch.randperm(seqs, generator=gen)[:1 + step % seqs]]
        positions = caches[0].written[batch, 0].clone()
        static = bool((positions > delay).all())
        static_steps += static
        for i, cache in enumerate(caches):
            cache.begin_decode(batch, static=static and i >= static_from)
        for layer in range(LAYERS):
            keys, values = torch.randn(2, len(batch), kv, DIM, generator=gen)
            alpha = (torch.rand(len(batch), kv, generator=gen) < 0.5).float()
            omega = torch.rand(len(batch), kv, generator=gen) + 0.1
            write(caches, layer, batch, positions, keys, values, omega, alpha)
        for cache in caches:
            cache.settle()
        for name in EXACT:
            for other in caches[1:]:
                assert torch.equal(getattr(caches[0], name), getattr(other, name)), (step, name)
        for name in CLOSE:
            for first, second in pairs:
                assert torch.equal(getattr(caches[first], name), getattr(caches[second], name)), \
                    (step, name)
            for other in caches[1:]:
                torch.testing.assert_close(getattr(other, name).float(),
                                           getattr(caches[0], name).float(),
                                           atol=bf16_atol if dtype == torch.bfloat16 else 2e-5,
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
