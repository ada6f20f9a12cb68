"""Engine.abort: a waiting or running request stops, its pages return at once, the next step
returns it (``finish_reason="abort"``, the tokens so far), and the other requests go on as the
eval-mode model gives them, with or without overlapped steps (device copies apart, as on a
GPU)."""
import pytest

from dmc.inference import Engine, SamplingParams
from test_engine import build, check_against_model, prompts
from test_overlap import keep_device_copies_apart

pytestmark = pytest.mark.usefixtures("one_thread")


def results_by_id(engine):
    out = {}
    while engine.has_unfinished():
        for result in engine.step():
            out[result.request_id] = result
    return out


@pytest.mark.parametrize("window,overlap", [("vanilla", False), (3, False), (3, True),
                                            ("vanilla", True)])
def test_a_running_request_aborted_mid_decode(parallel_1x1, monkeypatch, window, overlap):
    keep_device_copies_apart(monkeypatch)
    model, runtime = build(2, window)
    prompt_list = prompts((13, 21, 7))
    greedy = SamplingParams(max_new_tokens=16)
    free_run = Engine(model, page_size=4, max_batch=4, chunk_size=5).generate(prompt_list, greedy)
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5, cuda_graphs=overlap,
                    overlap=overlap)
    ids = [engine.add_request(p, greedy) for p in prompt_list]
    while len(engine.scheduler.running) < 3 or min(
            len(s.generated) for s in engine.scheduler.running) < 5:
        engine.step()
    held = engine.cache.pages_in_use
    assert engine.abort(ids[1])
    assert engine.cache.pages_in_use < held and engine.num_running == 2
    results = results_by_id(engine)
    aborted = results[ids[1]]
    assert aborted.finish_reason == "abort" and 5 <= len(aborted.tokens) < 16
    assert aborted.tokens == free_run[1].tokens[:len(aborted.tokens)]
    assert aborted.kv_pages > 0 and aborted.compression.tokens == 21 + len(aborted.tokens) - 1
    kept = [results[ids[0]], results[ids[2]]]
    assert all(r.finish_reason == "length" and len(r.tokens) == 16 for r in kept)
    check_against_model(model, kept, [prompt_list[0], prompt_list[2]],
                        dmc=runtime is not None)
    assert engine.cache.pages_in_use == 0 and not engine.abort(ids[0])
    allocator = engine.cache.allocator
    assert (allocator.device_tables == allocator.tables).all()
    assert (allocator.device_lengths == allocator.lengths).all()


def test_a_waiting_request_aborted_and_unknown_ids(parallel_1x1):
    model, _ = build(2, 3)
    engine = Engine(model, page_size=4, max_batch=1, chunk_size=5)
    first, second = (engine.add_request(p, SamplingParams(max_new_tokens=4))
                     for p in prompts((9, 6)))
    engine.step()
    assert engine.num_waiting == 1 and engine.abort(second) and engine.num_waiting == 0
    assert not engine.abort(second) and not engine.abort(99)
    results = results_by_id(engine)
    assert results[second].finish_reason == "abort" and results[second].tokens == []
    assert results[second].kv_pages == 0 and results[first].finish_reason == "length"
    assert engine.cache.pages_in_use == 0
    third = engine.add_request(prompts((5,))[0], SamplingParams(max_new_tokens=8))
    engine.step()
    assert engine.abort(third) and engine.cache.pages_in_use == 0
    assert engine.has_unfinished()  # the last request aborted: its result still to come
    assert [r.finish_reason for r in engine.step()] == ["abort"]
    assert not engine.has_unfinished()
