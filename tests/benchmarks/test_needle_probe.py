"""benchmarks/needle_probe.py: a missed first value token is sorted by where the prediction
comes from (hand-worked prompt); --attention-scale scales the chosen layers only."""
from dmc.data.needle import NeedleExample

from conftest import load_benchmark

bench = load_benchmark("needle_probe")


def test_first_token_misses_are_sorted_by_their_source():
    hay_before, key, value, hay_after = [10, 7, 11, 12], [5, 6, 7], [20, 21], [13, 7, 14]
    prompt = hay_before + key + value + hay_after + key
    example = NeedleExample(tuple(prompt + value), len(prompt), len(hay_before), len(key),
                            len(value), 0.5)
    assert example.key == key and example.value == value
    # 11 and 14 follow the key's last token (7) outside the needle: an induction match on it
    assert bench._first_token_miss(example, 11) == "wrong_copy"
    assert bench._first_token_miss(example, 14) == "wrong_copy"
    assert bench._first_token_miss(example, 99) == "not_in_prompt"
    assert bench._first_token_miss(example, 12) == "other"  # in the prompt, after no 7


def test_attention_scale_multiplies_the_chosen_layers_softmax_scale(parallel_1x1, one_thread):
    import pytest
    import torch
    from tiny_models import VOCAB, build_tiny

    model, _ = build_tiny(4, seed=3)
    model.eval()
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40)[None]

    def logits():
        with torch.no_grad():
            return model(tokens, positions, None)

    before = logits()
    bench.scale_attention(model, "1.0")
    assert torch.equal(logits(), before)
    scales = [m.softmax_scale for m in model.modules() if hasattr(m, "softmax_scale")]
    bench.scale_attention(model, "2@1")
    after = [m.softmax_scale for m in model.modules() if hasattr(m, "softmax_scale")]
    assert after == [scales[0], 2 * scales[1]]
    assert not torch.allclose(logits(), before)
    for spec, fragment in (("2@2", "layers must be in 0..1"), ("x", "expected FACTOR")):
        with pytest.raises(ValueError, match=fragment):
            bench.scale_attention(model, spec)
