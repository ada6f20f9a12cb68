"""Block-table entries outside the pool (a reservation bug) met on the device
(:mod:`dmc.inference.kernels.faults`): the Triton kernels skip them and count them, the DMS
window move counts them, and the engine raises ``UnreservedPageError`` naming the head when it
reads the counter back with the step's lengths, eagerly and with overlapped steps. (The
compiled CPU kernels raise at once: test_kernels.py.)"""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.inference.block_allocator import BlockAllocator, TableEntries
from dmc.inference.kernels import paged_decode_reference
from dmc.inference.kernels.delayed_write import delayed_write
from dmc.inference.kernels.dmc_write import dmc_write
from dmc.inference.kernels.dms_write import dms_write
from dmc.inference.kernels.faults import UnreservedPageError, fault_counter, raise_faults
from dmc.inference.kernels.paged_decode import paged_decode
from test_dms_engine import build_dms
from test_engine import build, prompts
from test_kernels import random_paged_kv
from test_overlap import keep_device_copies_apart

pytestmark = pytest.mark.usefixtures("one_thread")

SEQS, LAYERS, HEADS, DIM, PAGES, PAGE_SIZE, WINDOW = 5, 2, 3, 8, 64, 4, 3


def pools_and_entry(entry, seed):
    """Block tables ``[SEQS, LAYERS, HEADS, 2]`` of shuffled pages where sequence 3's KV head 1
    in layer 1 has the entry ``entry`` (None: its page), random K/V pools and their copies:
    ``(generator, tables, that head's page, pools, pools before)``."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(PAGES, generator=gen)[:SEQS * LAYERS * HEADS * 2]
    tables = tables.reshape(SEQS, LAYERS, HEADS, 2).int()
    page = int(tables[3, 1, 1, 0])
    if entry is not None:
        tables[3, 1, 1, 0] = entry
    pools = [torch.randn(PAGES, PAGE_SIZE, DIM, generator=gen) for _ in range(2)]
    return gen, tables, page, pools, [p.clone() for p in pools]


def assert_written_but_that_page(pools, valid, before, page):
    """``pools`` equal ``valid`` (a write with a valid entry, which wrote slot 0 of ``page``)
    except slot 0 of ``page``, which kept its bytes from ``before``."""
    for got, want, old in zip(pools, valid, before):
        assert not torch.equal(want[page, 0], old[page, 0])  # the valid call wrote there
        torch.testing.assert_close(got[page, 0], old[page, 0], rtol=0, atol=0)
        want = want.clone()
        want[page, 0] = old[page, 0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def merge_state(gen):
    """Random windowed open-slot state ``(open_k, open_v, open_omega, open_count)`` of every
    head, one token in each open slot."""
    return [torch.randn(SEQS, LAYERS, HEADS, WINDOW, DIM, generator=gen),
            torch.randn(SEQS, LAYERS, HEADS, WINDOW, DIM, generator=gen),
            torch.rand(SEQS, LAYERS, HEADS, WINDOW, generator=gen) + 0.1,
            torch.ones(SEQS, LAYERS, HEADS, dtype=torch.int32)]


INV_FREQ = 10000.0 ** (-torch.arange(0, DIM, 2).float() / DIM)


def write_call(entry):
    """One Triton DMC write of sequence slots 3 and 0 in layer 1, each head appending at slot 0,
    where sequence 3's KV head 1 has the block-table entry ``entry``; returns the pools after
    it, the pools before, the page that head would hold and the fault counter."""
    gen, tables, page, pools, before = pools_and_entry(entry, seed=5)
    state = merge_state(gen)
    keys, values = (torch.randn(2, HEADS, DIM, generator=gen) for _ in range(2))
    faults = fault_counter("cpu")
    dmc_write(*pools, tables, *state, INV_FREQ, WINDOW, 1, torch.tensor([3, 0]),
              torch.zeros(2, HEADS, dtype=torch.long), torch.ones(2, HEADS, dtype=torch.bool),
              keys, values, torch.ones(2, HEADS), torch.tensor([6, 5]), faults=faults)
    return pools, before, page, faults


@pytest.mark.parametrize("entry", [-1, PAGES], ids=["unreserved", "past-the-pool"])
def test_triton_write_skips_and_counts_an_entry_outside_the_pool(entry):
    """The head whose entry is not a page is not written (its page keeps its bytes; nothing
    outside the pool is touched: the interpreter would fault), every other head is written as
    with a valid entry, and the counter holds one entry at that head's flat index."""
    valid, before, page, valid_faults = write_call(None)
    pools, _, _, faults = write_call(entry)
    assert valid_faults.tolist() == [0, -1]
    assert faults.tolist() == [1, (3 * LAYERS + 1) * HEADS + 1]
    assert_written_but_that_page(pools, valid, before, page)


def dms_write_call(entry):
    """One Triton DMS write of sequence rows 3 and 0 in layer 1, every head's ring full (token
    p - R leaves, kept) and its length 0, where row 3's KV head 1 has the block-table entry
    ``entry``; returns the pools after it, the pools before, that head's page, the lengths and
    the fault counter."""
    gen, tables, page, pools, before = pools_and_entry(entry, seed=6)
    lengths = torch.zeros(SEQS, LAYERS, HEADS, dtype=torch.int32)
    rings = [torch.randn(SEQS, LAYERS, HEADS, WINDOW, DIM, generator=gen) for _ in range(2)]
    flags = torch.zeros(SEQS, LAYERS, HEADS, WINDOW, dtype=torch.bool)
    keys, values = (torch.randn(2, HEADS, DIM, generator=gen) for _ in range(2))
    faults = fault_counter("cpu")
    dms_write(*pools, tables, lengths, *rings, flags, 1, torch.tensor([3, 0]),
              torch.tensor([WINDOW + 1, WINDOW]), keys, values,
              torch.zeros(2, HEADS, dtype=torch.bool), faults)
    return pools, before, page, lengths, faults


@pytest.mark.parametrize("entry", [-1, PAGES], ids=["unreserved", "past-the-pool"])
def test_triton_dms_write_skips_and_counts_an_entry_outside_the_pool(entry):
    """The same for the DMS write (the token leaving a full ring): that head's page keeps its
    bytes, every other head's token lands as with a valid entry, the counter holds the head."""
    valid, before, page, valid_lengths, valid_faults = dms_write_call(None)
    pools, _, _, lengths, faults = dms_write_call(entry)
    assert valid_faults.tolist() == [0, -1]
    assert faults.tolist() == [1, (3 * LAYERS + 1) * HEADS + 1]
    assert valid_lengths[[3, 0], 1].eq(1).all() and torch.equal(lengths, valid_lengths)
    assert_written_but_that_page(pools, valid, before, page)


def delayed_write_call(entry):
    """One Triton write of DMC with delayed merging (ring of 3 rows, full) of sequence rows 3
    and 0 in layer 1, every leaving token appended at slot 0, where row 3's KV head 1 has the
    block-table entry ``entry``; returns the pools after it, the pools before, that head's
    page, the lengths and the fault counter."""
    gen, tables, page, pools, before = pools_and_entry(entry, seed=7)
    lengths = torch.zeros(SEQS, LAYERS, HEADS, dtype=torch.int32)
    rings = [torch.randn(SEQS, LAYERS, HEADS, 3, DIM, generator=gen) for _ in range(2)]
    decisions = [torch.zeros(SEQS, LAYERS, HEADS, 3), torch.rand(SEQS, LAYERS, HEADS, 3) + 0.1]
    keys, values = (torch.randn(2, HEADS, DIM, generator=gen) for _ in range(2))
    faults = fault_counter("cpu")
    delayed_write(*pools, tables, lengths, *merge_state(gen), *rings, *decisions, INV_FREQ,
                  WINDOW, 1, torch.tensor([3, 0]), torch.tensor([4, 3]), keys, values,
                  torch.ones(2, HEADS), torch.zeros(2, HEADS), faults)
    return pools, before, page, lengths, faults


@pytest.mark.parametrize("entry", [-1, PAGES], ids=["unreserved", "past-the-pool"])
def test_triton_delayed_write_skips_and_counts_an_entry_outside_the_pool(entry):
    """The same for the write of DMC with delayed merging (the token leaving a full ring
    through Algorithm 1): that head's page keeps its bytes, every other head's token lands as
    with a valid entry, the lengths grow, the counter holds the head."""
    valid, before, page, valid_lengths, valid_faults = delayed_write_call(None)
    pools, _, _, lengths, faults = delayed_write_call(entry)
    assert valid_faults.tolist() == [0, -1]
    assert faults.tolist() == [1, (3 * LAYERS + 1) * HEADS + 1]
    assert valid_lengths[[3, 0], 1].eq(1).all() and torch.equal(lengths, valid_lengths)
    assert_written_but_that_page(pools, valid, before, page)


def dense_without_pages(q, k_pages, v_pages, tables, lengths, scale):
    """Float64 attention of each query over its head's slots that lie on pages of the pool."""
    batch, q_heads, _ = q.shape
    group = q_heads // tables.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            slots = torch.arange(int(lengths[b, h // group]))
            pages = tables[b, h // group, slots // PAGE_SIZE].long()
            inside = (pages >= 0) & (pages < len(k_pages))
            slots, pages = slots[inside], pages[inside]
            keys = k_pages[pages, slots % PAGE_SIZE].double()
            probs = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = probs @ v_pages[pages, slots % PAGE_SIZE].double()
    return out


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("entry", [-1, 10_000], ids=["unreserved", "past-the-pool"])
def test_triton_decode_skips_and_counts_the_slots_of_an_entry_outside_the_pool(entry,
                                                                               num_splits):
    gen = torch.Generator().manual_seed(9)
    lengths = torch.tensor([[11, 3], [6, 9]])
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, DIM, PAGE_SIZE, torch.float32,
                                                        gen)
    q = torch.randn(2, 4, DIM, generator=gen)
    expected_valid = paged_decode_reference(q, k_pages, v_pages, tables, lengths, 0.5)
    tables[0, 0, 1] = entry  # slots 4-7 of a head of 11
    tables[1, 1, 2] = entry  # slot 8 of a head of 9
    faults = fault_counter("cpu")
    out = paged_decode(q, k_pages, v_pages, tables, lengths, 0.5, num_splits=num_splits,
                       faults=faults)
    assert faults.tolist() == [4 + 1, -1]  # reads do not know the sequence slot
    torch.testing.assert_close(out.double(), dense_without_pages(q, k_pages, v_pages, tables,
                                                                 lengths, 0.5),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :2], expected_valid[1, :2])  # heads with valid entries


def test_the_counter_message_names_the_head():
    raise_faults(torch.tensor([0, -1]), LAYERS, HEADS)
    with pytest.raises(UnreservedPageError, match="2 block-table entries.*sequence slot 3, "
                                                  "layer 1, KV head 2"):
        raise_faults(torch.tensor([2, (3 * LAYERS + 1) * HEADS + 2]), LAYERS, HEADS)
    with pytest.raises(UnreservedPageError, match="1 block-table entry .*in a read"):
        raise_faults(torch.tensor([1, -1]), LAYERS, HEADS)


def drop_one_decode_reservation(monkeypatch) -> list[TableEntries]:
    """From now on the first page a decode step reserves (``_take_next``) is handed back at
    once and its entry left -1: a reservation bug. Returns the dropped entry (once it is)."""
    dropped = []
    take_next = BlockAllocator._take_next

    def leaky(self, seqs, heads, ahead=0):
        entries = take_next(self, seqs, heads, ahead)
        if dropped or not len(entries.pages):
            return entries
        first = TableEntries(*(part[:1] for part in entries))
        self.tables[first.index] = -1
        self._give_back(first.pages)
        dropped.append(first)
        return TableEntries(*(part[1:] for part in entries))

    monkeypatch.setattr(BlockAllocator, "_take_next", leaky)
    return dropped


def raise_without_a_page(monkeypatch, kind, overlap, cuda_graphs):
    """Serve two requests with one decode reservation dropped; check the error names the head
    that lost its page."""
    model = build(2, 3, c=20.0)[0] if kind == "dmc" else build_dms(2, 4)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=4, use_triton=True,
                    cuda_graphs=cuda_graphs, overlap=overlap)
    dropped = drop_one_decode_reservation(monkeypatch)
    with pytest.raises(UnreservedPageError, match="decode step met") as raised:
        engine.generate(prompts((9, 5)), SamplingParams(max_new_tokens=24))
    (entry,) = dropped
    head = f"sequence slot {int(entry.seq)}, layer {int(entry.layer)}, KV head {int(entry.head)}"
    assert head in str(raised.value)
    return engine


@pytest.mark.parametrize("kind,overlap", [("dmc", False), ("dmc", True), ("dms", False),
                                          ("dms", True)])
def test_a_step_without_its_page_raises_naming_the_head(parallel_1x1, monkeypatch, kind,
                                                        overlap):
    """A decode step whose head lost its reserved page (every DMC head appends here; a DMS
    head writes the token leaving its ring whether kept or not) is not followed outside the
    pool by the Triton kernels (the interpreter) or the DMS move (static steps); the engine
    raises when it reads the step back, naming the sequence slot, layer and KV head. With
    overlapped steps the device copies are kept apart, as on a GPU."""
    if overlap:
        keep_device_copies_apart(monkeypatch)
    raise_without_a_page(monkeypatch, kind, overlap, cuda_graphs=overlap or kind == "dms")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,overlap,cuda_graphs", [("dmc", False, False), ("dmc", True, True),
                                                      ("dms", False, True)])
def test_on_cuda_a_step_without_its_page_raises_and_the_device_goes_on(parallel_1x1, monkeypatch,
                                                                       kind, overlap,
                                                                       cuda_graphs):
    """The same on a GPU (eager, replayed from CUDA graphs, overlapped): the error names the
    head, and the CUDA context is alive afterwards (no illegal address was touched)."""
    engine = raise_without_a_page(monkeypatch, kind, overlap, cuda_graphs)
    assert engine.cache.k_pages.is_cuda
    torch.cuda.synchronize()
    assert torch.ones(2, device="cuda").sum().item() == 2
