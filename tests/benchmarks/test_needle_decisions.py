"""benchmarks/needle_decisions.py: which slots hold a token alone under DMC's and DMS's decisions
(hand-worked cases), and the decisions it records are the ones the model's forward takes (a
model that never merges holds every token whole, one that always merges none)."""
import random

import pytest
import torch

from dmc.data.needle import make_needle_examples
from tests.tiny_models import VOCAB, build_tiny

from conftest import load_benchmark

bench = load_benchmark("needle_decisions")


def test_held_whole_by_hand():
    alpha = torch.tensor([[[0., 1., 0., 0., 1., 1.]]])
    # DMC: token 0's slot takes token 1; token 2 opens a slot and token 3 another, which
    # token 4 joins, then token 5
    assert bench.held_whole(alpha, "dmc").tolist() == [[[0, 0, 1, 0, 0, 0]]]
    # DMS: alpha_{t+1} evicts token t
    assert bench.held_whole(alpha, "dms").tolist() == [[[0, 1, 1, 0, 0, 1]]]
    # a window: the query sees positions 4 and 5 (first example) or 2.. (second) raw
    two = alpha.expand(2, 1, 6)
    assert bench.held_whole(two, "dmc", torch.tensor([4, 2])).tolist() == [
        [[0, 0, 1, 0, 1, 1]], [[0, 0, 1, 1, 1, 1]]]
    with pytest.raises(ValueError, match="method: expected dmc or dms"):
        bench.held_whole(alpha, "gqa")


def test_token_kinds_mark_the_needle_and_leave_out_the_query():
    rng = random.Random(0)
    stream = [rng.randrange(4, VOCAB) for _ in range(2000)]
    example = make_needle_examples(stream, 64, 1, depths=(0.5,))[0]
    kinds = bench.token_kinds(example, len(example.tokens))
    start = example.needle_start
    assert kinds[start:start + 8].tolist() == [1] * 8
    assert kinds[start + 8:start + 12].tolist() == [2] * 4
    assert (kinds[example.prompt_len - 8:] == -1).all() and (kinds[:start] == 0).all()


@pytest.mark.parametrize("c,expected", [(50.0, 1.0), (-50.0, 0.0)])
def test_recorded_decisions_are_the_forwards(parallel_1x1, c, expected):
    model, _ = build_tiny(2, window=4, c=c)
    rng = random.Random(1)
    stream = [rng.randrange(4, VOCAB) for _ in range(2000)]
    examples = make_needle_examples(stream, 64, 3)
    rows = bench.measure(model, "dmc", examples)
    assert len(rows) == 2
    for row in rows:
        assert row["haystack"] == row["key"] == row["value"] == expected
        assert row["value_per_head"] == [expected] * 2
    assert all("_compressed_attention" not in vars(layer.self_attention)
               for layer in model.decoder.layers)  # the recording is removed
    if expected == 0.0:  # a raw window of 40 tokens: the value tokens it reaches are whole
        windowed = bench.measure(model, "dmc", examples, window=40)
        values = [range(e.needle_start + e.key_len, e.needle_start + e.key_len + e.value_len)
                  for e in examples]
        seen = sum(t >= e.prompt_len - 41 for e, span in zip(examples, values) for t in span)
        assert windowed[0]["value"] == pytest.approx(seen / sum(map(len, values)))
        assert 0 < seen < sum(map(len, values))
