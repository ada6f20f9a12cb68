"""BlockAllocator: the device copies of the block tables and lengths follow the host ones
through every operation, and every head owns exactly the pages its length needs. On a CPU the
device copies are the host tensors; here they are made separate, as on a GPU, so the copies
that only send the entries a step changed are checked against the host state."""
import random

import pytest
import torch

from dmc.inference.block_allocator import (
    BlockAllocator,
    at_page_boundary,
    page_and_offset,
    pages_for,
)

LAYERS, HEADS, PAGES, PAGE, SEQS, WIDTH = 3, 2, 200, 4, 6, 12


def separate_device_copies(page: int = PAGE) -> BlockAllocator:
    alloc = BlockAllocator(LAYERS, HEADS, PAGES, page, SEQS, WIDTH, torch.device("cpu"))
    alloc.device_tables = alloc.tables.clone()
    alloc.device_lengths = alloc.lengths.clone()
    return alloc


def check(alloc: BlockAllocator) -> None:
    assert torch.equal(alloc.device_tables, alloc.tables)
    assert torch.equal(alloc.device_lengths, alloc.lengths)
    owned = alloc.tables[alloc.tables >= 0].tolist()
    assert sorted(owned + alloc.free_list) == list(range(PAGES))
    columns = torch.arange(WIDTH)
    needed = columns < -(-alloc.lengths.long()[..., None] // alloc.page_size)
    assert torch.equal(alloc.tables >= 0, needed)


@pytest.mark.parametrize("page", [PAGE, 3])
def test_device_copies_follow_every_operation(page):
    """Random operations, at a page size that is a power of two (shifts and masks) and one
    that is not (integer division)."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    alloc, active = separate_device_copies(page), []
    for _ in range(300):
        op = rng.choice(["add", "grow", "append", "step", "shrink", "free"])
        if op == "add" and len(active) < SEQS:
            active.append(alloc.add_sequence())
        elif not active:
            continue
        elif op == "grow":
            seq, layer = rng.choice(active), rng.randrange(LAYERS)
            seqs = torch.tensor([seq])
            grown = alloc.lengths[seqs, layer].long() + torch.randint(0, 6, (1, HEADS),
                                                                      generator=gen)
            alloc.grow(seqs, layer, grown.clamp(max=WIDTH * page - 2))
        elif op == "append":
            seqs = alloc.rows(rng.sample(active, rng.randint(1, len(active))))
            if (alloc.lengths[seqs.host] < WIDTH * page - 2).all():
                alloc.append_all(seqs)
        elif op == "step":
            seqs = torch.tensor(rng.sample(active, rng.randint(1, len(active))))
            if (alloc.lengths[seqs] >= WIDTH * page - 2).any():
                continue
            alloc.reserve_step(seqs, alloc.lengths[seqs] % page == 0)
            appended = torch.randint(0, 2, alloc.lengths[seqs].shape, generator=gen)
            alloc.device_lengths[seqs] += appended.int()  # what the device's writes do
            alloc.settle()
        elif op == "shrink":
            seq, layer = rng.choice(active), rng.randrange(LAYERS)
            seqs = torch.tensor([seq])
            alloc.shrink(seqs, layer, alloc.lengths[seqs, layer].long() // 2)
        elif op == "free":
            seq = active.pop(rng.randrange(len(active)))
            alloc.free_sequence(seq)
        check(alloc)
    assert alloc.pages_in_use > 0


def test_settle_gives_back_exactly_the_reserved_pages_of_heads_that_did_not_append():
    alloc = separate_device_copies()
    seq = alloc.add_sequence()
    seqs = torch.tensor([seq])
    for layer in range(LAYERS):
        alloc.grow(seqs, layer, torch.full((1, HEADS), PAGE))  # every head at a page boundary
    free = alloc.free_pages
    alloc.reserve_step(seqs, alloc.lengths[seqs] % PAGE == 0)
    assert alloc.free_pages == free - LAYERS * HEADS
    alloc.device_lengths[seq, 0, 0] += 1  # one head appends
    carry = alloc.settle(torch.tensor([7.0], dtype=torch.float64))
    assert carry.tolist() == [7.0]
    assert alloc.free_pages == free - 1 and alloc.lengths[seq, 0, 0] == PAGE + 1
    check(alloc)


@pytest.mark.parametrize("page", [1, 3, 4, 16, 24])
def test_page_arithmetic_equals_python_divmod(page):
    slots = torch.arange(0, 200, dtype=torch.int32)
    column, offset = page_and_offset(slots, page)
    assert column.tolist() == [n // page for n in range(200)]
    assert offset.tolist() == [n % page for n in range(200)]
    assert pages_for(slots, page).tolist() == [-(-n // page) for n in range(200)]
    assert at_page_boundary(slots, page).tolist() == [n % page == 0 for n in range(200)]


def test_a_step_reserves_only_at_page_boundaries():
    """reserve_step takes the marked heads' next page where their length ends a page; a head
    marked elsewhere is refused before anything changes."""
    alloc = separate_device_copies()
    seqs = torch.tensor([alloc.add_sequence()])
    alloc.grow(seqs, 0, torch.tensor([[PAGE, 1]]))
    heads = torch.zeros(1, LAYERS, HEADS, dtype=torch.bool)
    heads[0, 0, 1] = True
    free = alloc.free_pages
    with pytest.raises(ValueError, match="page boundary"):
        alloc.reserve_step(seqs, heads)
    assert alloc.free_pages == free and alloc.step is None
    heads[0, 0] = torch.tensor([True, False])
    alloc.reserve_step(seqs, heads)
    assert alloc.free_pages == free - 1 and alloc.tables[seqs[0], 0, 0, 1] >= 0
    alloc.settle()
    check(alloc)
