"""BlockAllocator: the device copies of the block tables and lengths follow the host ones
through every operation, and every head owns exactly the pages its length needs. On a CPU the
device copies are the host tensors; here they are made separate, as on a GPU, so the copies
that only send the entries a step changed are checked against the host state."""
import random

import torch

from dmc.inference.block_allocator import BlockAllocator, pages_for

LAYERS, HEADS, PAGES, PAGE, SEQS, WIDTH = 3, 2, 200, 4, 6, 12


def separate_device_copies() -> BlockAllocator:
    alloc = BlockAllocator(LAYERS, HEADS, PAGES, PAGE, SEQS, WIDTH, torch.device("cpu"))
    alloc.device_tables = alloc.tables.clone()
    alloc.device_lengths = alloc.lengths.clone()
    return alloc


def check(alloc: BlockAllocator) -> None:
    assert torch.equal(alloc.device_tables, alloc.tables)
    assert torch.equal(alloc.device_lengths, alloc.lengths)
    owned = alloc.tables[alloc.tables >= 0].tolist()
    assert sorted(owned + alloc.free_list) == list(range(PAGES))
    columns = torch.arange(WIDTH)
    needed = columns < pages_for(alloc.lengths.long(), PAGE)[..., None]
    assert torch.equal(alloc.tables >= 0, needed)


def test_device_copies_follow_every_operation():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    alloc, active = separate_device_copies(), []
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
            alloc.grow(seqs, layer, grown.clamp(max=WIDTH * PAGE - 2))
        elif op == "append":
            seqs = alloc.rows(rng.sample(active, rng.randint(1, len(active))))
            if (alloc.lengths[seqs.host] < WIDTH * PAGE - 2).all():
                alloc.append_all(seqs)
        elif op == "step":
            seqs = torch.tensor(rng.sample(active, rng.randint(1, len(active))))
            if (alloc.lengths[seqs] >= WIDTH * PAGE - 2).any():
                continue
            alloc.reserve_step(seqs, alloc.lengths[seqs] % PAGE == 0)
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
