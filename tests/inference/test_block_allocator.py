"""BlockAllocator: the device copies of the block tables and lengths follow the host ones
through every operation, and every head owns exactly the pages its length needs. On a CPU the
device copies are the host tensors; here they are made separate, as on a GPU, so the copies
that only send the entries a step changed are checked against the host state."""
import random

import pytest
import torch

from dmc.inference.block_allocator import BlockAllocator

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


def test_a_step_reserves_the_page_of_a_marked_heads_next_slot_where_it_holds_none():
    """reserve_step gives a marked head the page its next slot falls in: a head at a page
    boundary takes one, a head in mid-page (its page held) takes nothing."""
    alloc = separate_device_copies()
    seqs = torch.tensor([alloc.add_sequence()])
    alloc.grow(seqs, 0, torch.tensor([[PAGE, 1]]))
    heads = torch.zeros(1, LAYERS, HEADS, dtype=torch.bool)
    heads[0, 0] = True
    free = alloc.free_pages
    alloc.reserve_step(seqs, heads)
    assert alloc.free_pages == free - 1 and alloc.tables[seqs[0], 0, 0, 1] >= 0
    alloc.settle()
    check(alloc)


def writable(alloc: BlockAllocator, seqs: torch.Tensor) -> bool:
    """Whether every head of ``seqs`` holds, on the device, the page of the slot its next
    append writes (the device length)."""
    columns = alloc.device_lengths[seqs].long() // alloc.page_size
    return bool((alloc.device_tables[seqs].gather(-1, columns[..., None]) >= 0).all())


@pytest.mark.parametrize("page", [PAGE, 3])
def test_two_open_steps_keep_every_write_on_a_held_page(page):
    """The overlap of two decode steps of the same sequences (the second reserved before the
    first's lengths are back, the first settled from the lengths its device work reached): each
    step's appends land on pages the head holds, whatever the other step decided; when both are
    settled every head holds exactly the pages its length needs and the free list the rest."""
    gen = torch.Generator().manual_seed(1)
    alloc = separate_device_copies(page)
    seqs = torch.tensor([alloc.add_sequence() for _ in range(3)])
    for layer in range(LAYERS):
        alloc.grow(seqs, layer, torch.randint(0, 3 * page, (3, HEADS), generator=gen))
    for round_ in range(10):
        def device_step():
            assert writable(alloc, seqs)
            appended = torch.randint(0, 2, alloc.lengths[seqs].shape, generator=gen)
            alloc.device_lengths[seqs] += appended.int()  # what the device's writes do

        alloc.reserve_step(seqs, torch.ones(3, LAYERS, HEADS, dtype=torch.bool))
        device_step()
        reached = alloc.step_lengths().clone()
        alloc.reserve_step(seqs, torch.ones(3, LAYERS, HEADS, dtype=torch.bool))
        assert alloc.lookahead == 2
        if round_ % 2:  # the first settles before or after the second's writes
            device_step()
            alloc.settle(reached=reached)
        else:
            alloc.settle(reached=reached)
            device_step()
        assert torch.equal(alloc.lengths[seqs], reached) and torch.equal(
            alloc.device_tables, alloc.tables)
        alloc.settle()
        check(alloc)
    alloc.reserve_step(seqs[:2], torch.ones(2, LAYERS, HEADS, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="settle first"):  # a sequence the open step lacks
        alloc.reserve_step(seqs, torch.ones(3, LAYERS, HEADS, dtype=torch.bool))
    alloc.reserve_step(seqs[1:2], torch.ones(1, LAYERS, HEADS, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="settle first"):  # two steps open already
        alloc.reserve_step(seqs[1:2], torch.ones(1, LAYERS, HEADS, dtype=torch.bool))


def test_settle_of_an_older_step_needs_its_lengths_while_a_later_one_is_open():
    alloc = separate_device_copies()
    seqs = torch.tensor([alloc.add_sequence()])
    for _ in range(2):
        alloc.reserve_step(seqs, torch.ones(1, LAYERS, HEADS, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="pass the lengths"):
        alloc.settle()


def test_a_pipeline_of_steps_tracks_only_the_pages_still_undecided():
    """Steps of the same sequences opened one ahead of the settle, as the engine's overlap does
    for many steps: at every settle the next open step tracks at most one reserved page per
    head (those a step in flight may still fill), not every page ever reserved; at the end
    each head holds exactly the pages its length needs."""
    gen = torch.Generator().manual_seed(2)
    alloc = separate_device_copies()
    seqs = torch.tensor([alloc.add_sequence() for _ in range(2)])
    every = torch.ones(2, LAYERS, HEADS, dtype=torch.bool)

    def device_step():
        assert writable(alloc, seqs)
        alloc.device_lengths[seqs] += torch.randint(0, 2, (2, LAYERS, HEADS), generator=gen,
                                                    dtype=torch.int32)
        return alloc.step_lengths().clone()

    alloc.reserve_step(seqs, every)
    reached = device_step()
    for _ in range(40):  # lengths grow by at most 41 of the 48 slots a head may hold
        alloc.reserve_step(seqs, every)
        next_reached = device_step()
        alloc.settle(reached=reached)
        reached = next_reached
        assert len(alloc.steps[0].reserved.pages) <= 2 * LAYERS * HEADS
    alloc.settle()
    check(alloc)


@pytest.mark.parametrize("page", [PAGE, 3])
def test_a_pipeline_that_drops_sequences_keeps_pages_of_the_rest_only(page):
    """Overlapped steps whose batch shrinks (the engine's overlap going on when sequences
    end): the next step opens for some of the sequences of the step still open; settling that
    one leaves a sequence no open step writes with exactly the pages of its length (none
    handed on), so freeing it then returns each page once; every write of the others lands on
    a held page, and at the end every head holds the pages its length needs."""
    gen = torch.Generator().manual_seed(3)
    alloc = separate_device_copies(page)
    batch = [alloc.add_sequence() for _ in range(SEQS)]
    for layer in range(LAYERS):
        alloc.grow(torch.tensor(batch), layer, torch.randint(0, 3 * page, (SEQS, HEADS),
                                                              generator=gen))

    def device_step(seqs):
        assert writable(alloc, seqs)
        alloc.device_lengths[seqs] += torch.randint(0, 2, (len(seqs), LAYERS, HEADS),
                                                    generator=gen, dtype=torch.int32)
        return alloc.step_lengths().clone()

    seqs = torch.tensor(batch)
    alloc.reserve_step(seqs, torch.ones(len(seqs), LAYERS, HEADS, dtype=torch.bool))
    reached = device_step(seqs)
    while len(seqs) > 1:
        going_on = seqs[torch.randperm(len(seqs), generator=gen)[:len(seqs) - 1].sort().values]
        alloc.reserve_step(going_on, torch.ones(len(going_on), LAYERS, HEADS, dtype=torch.bool))
        next_reached = device_step(going_on)
        alloc.settle(reached=reached)
        ended = seqs[~torch.isin(seqs, going_on)]
        held = alloc.tables[ended] >= 0
        needed = torch.arange(WIDTH) < -(-alloc.lengths[ended].long()[..., None] // page)
        assert torch.equal(held, needed)  # no page beyond its length, none handed on
        assert not torch.isin(alloc.steps[0].reserved.seq, ended).any()
        alloc.free_sequence(int(ended[0]))
        seqs, reached = going_on, next_reached
    alloc.settle(reached=reached)
    check(alloc)
