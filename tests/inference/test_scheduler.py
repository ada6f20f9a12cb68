"""Scheduler and batched chunked prefill: several prompts' chunks and the decode tokens in one
forward give the one-at-a-time results; pages are reserved (and sequences preempted) before a
forward, never inside it; every page is free at the end."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
LENGTHS = (13, 41, 7, 26, 3, 58, 19, 33, 1, 47)


def prompts(lengths=LENGTHS, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def count_segments(engine):
    """Record the (prefill chunks, decode tokens) of every forward of ``engine``."""
    seen, forward = [], engine.runner.forward

    def recording(segments):
        seen.append((sum(not s.decode for s in segments), sum(s.decode for s in segments)))
        return forward(segments)

    engine.runner.forward = recording
    return seen


@pytest.mark.parametrize("window", [3, None, "vanilla"])
def test_batched_chunked_prefill_equals_one_at_a_time(window):
    model, _ = build_tiny(2, window, -1.0, max_seq=160)
    params = [SamplingParams(max_new_tokens=6 + i % 4, temperature=0.0 if i % 2 else 0.8,
                             seed=i) for i in range(len(LENGTHS))]
    one = Engine(model, page_size=4, max_batch=6, chunk_size=8, batch_prefill=False)
    batched = Engine(model, page_size=4, max_batch=6, chunk_size=8, step_tokens=40)
    forwards = count_segments(batched)
    expected = one.generate(prompts(), params)
    results = batched.generate(prompts(), params)
    assert max(chunks for chunks, _ in forwards) >= 3  # several prompts' chunks in one forward
    assert any(chunks and decodes for chunks, decodes in forwards)  # mixed with decode tokens
    for want, got in zip(expected, results):
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
        assert torch.equal(got.compression.slots, want.compression.slots)
    for engine in (one, batched):
        assert engine.cache.pages_in_use == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("window,pages", [(3, 52), ("vanilla", 84)])
def test_a_tiny_pool_preempts_before_the_forward_never_inside(window, pages):
    """The pool holds about one of the longest sequence (58 + 23 tokens, 2 layers x 2 heads of
    pages of 4; about half under DMC): every step must reserve or preempt."""
    model, _ = build_tiny(2, window, -1.0, max_seq=160)
    params = SamplingParams(max_new_tokens=24)
    roomy = Engine(model, page_size=4, max_batch=4, chunk_size=8)
    expected = roomy.generate(prompts(LENGTHS[:6]), params)
    tight = Engine(model, page_size=4, max_batch=4, chunk_size=8, num_pages=pages)
    in_forward, forward, free = [False], tight.runner.forward, tight.cache.free_sequence
    preempted_inside = []

    def tracking_forward(segments):
        in_forward[0] = True
        try:
            return forward(segments)
        finally:
            in_forward[0] = False

    def tracking_free(slot):
        preempted_inside.append(in_forward[0])
        free(slot)

    tight.runner.forward, tight.cache.free_sequence = tracking_forward, tracking_free
    results = tight.generate(prompts(LENGTHS[:6]), params)
    assert tight.stats.preemptions > 0 and not any(preempted_inside)
    for want, got in zip(expected, results):
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
    assert tight.cache.pages_in_use == 0 and tight.cache.free_pages == pages


def test_step_tokens_must_hold_every_decode_token_and_a_chunk():
    model, _ = build_tiny(2, "vanilla", -1.0, max_seq=160)
    with pytest.raises(ValueError, match="max_batch \\+ chunk_size"):
        Engine(model, page_size=4, max_batch=4, chunk_size=8, step_tokens=11)


def test_the_last_chunk_of_each_prefill_ends_the_prompt():
    """Segments mark ``prompt_end`` on the chunk that ends what is prefilled before decoding
    (there a policy under the "prefill" schedule compresses): in batched generation and in
    score(prefill_tokens=...)."""
    model, _ = build_tiny(2, "vanilla", -1.0, max_seq=160)
    engine = Engine(model, page_size=4, max_batch=6, chunk_size=8, step_tokens=40)
    chunks, forward = [], engine.runner.forward

    def recording(segments):
        chunks.extend(s for s in segments if not s.decode)
        return forward(segments)

    engine.runner.forward = recording
    engine.generate(prompts(), SamplingParams(max_new_tokens=3))
    ends = [(s.start + len(s.tokens), s.prompt_end) for s in chunks]
    assert sorted(end for end, last in ends if last) == sorted(LENGTHS)
    assert all(end % 8 == 0 for end, last in ends if not last)
    chunks.clear()
    engine.score(prompts()[1], prefill_tokens=20)
    assert [(s.start + len(s.tokens), s.prompt_end) for s in chunks] == [(8, False), (16, False),
                                                                         (20, True)]


def test_a_sequence_counts_and_ends_its_tokens_without_building_them():
    from dmc.inference.sequence import Sequence

    seq = Sequence(request_id=0, prompt=[5, 6, 7], params=SamplingParams(max_new_tokens=4),
                   seed=0)
    for new in (None, 9, 2):
        if new is not None:
            seq.generated.append(new)
        assert (seq.num_tokens, seq.last_token) == (len(seq.tokens), seq.tokens[-1])


def test_the_runner_takes_decode_segments_first():
    """ModelRunner.forward returns its logits row by row in the order of the segments, the
    decode tokens first (the order the scheduler plans): any other order is refused."""
    from dmc.inference.model_runner import Segment

    model, _ = build_tiny(2, 3, -1.0, max_seq=32)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=8)
    with pytest.raises(ValueError, match="decode segments must come first"):
        engine.runner.forward([Segment(0, [1, 2], 0), Segment(1, [3], 5, decode=True)])


@pytest.mark.parametrize("extra_pages, admitted", [(0, False), (1, True)])
def test_a_prompt_is_admitted_beside_others_only_with_a_page_per_head_to_spare(extra_pages,
                                                                               admitted):
    """While a sequence decodes, a waiting prompt of 24 tokens (6 pages of 4 at CR 1, one
    layer of one KV head) is admitted only when the pages left hold its estimate plus one
    page per head: with exactly 6 free it waits, with 7 it is prefilled."""
    from dmc.inference.cache import PagedKVCache
    from dmc.inference.scheduler import Scheduler
    from dmc.inference.sequence import Sequence

    cache = PagedKVCache(1, 1, 8, num_pages=10 + extra_pages, page_size=4, max_seqs=4,
                         window=None, dtype=torch.float32, max_seq_len=64)
    scheduler = Scheduler(cache, max_batch=4, chunk_size=8, step_tokens=12)
    running = Sequence(0, list(range(13)), SamplingParams(max_new_tokens=8), 0, generated=[1])
    running.slot, running.cached, running.decoding = cache.add_sequence(), 13, True
    cache.allocator.grow(torch.tensor([running.slot]), 0, torch.tensor([[13]]))  # 4 pages
    scheduler.running.append(running)
    scheduler.add(Sequence(1, list(range(24)), SamplingParams(max_new_tokens=8), 1))
    assert cache.free_pages == 6 + extra_pages
    plan = scheduler.schedule()
    assert plan.decode == [running]
    assert [seq.request_id for seq, _ in plan.prefill] == ([1] if admitted else [])
    assert len(scheduler.running) == 1 + admitted
