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


def test_needle_attention_weights_are_those_the_core_attention_used(parallel_1x1, one_thread):
    """attention_row's weights, times the core attention's values, give its output at that
    position (GQA: 4 query heads over 2 groups), so they are the model's own softmax; and
    needle_attention sorts the examples by the argmax of the value's first token."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from tiny_models import VOCAB, build_tiny

    model, _ = build_tiny(2, seed=3)
    model.eval()
    core = next(m for m in model.modules() if isinstance(m, DotProductAttention))
    seen = {}
    core.register_forward_hook(lambda module, args, out: seen.update(args=args, out=out))
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens, torch.arange(30)[None], None)[0]
    query, key, value = seen["args"][:3]
    heads, groups = query.shape[2], key.shape[2]
    assert (heads, groups) == (4, 2)
    for at in (0, 17, 29):
        weights = bench.attention_row(query, key, core.softmax_scale, at)  # [heads, at + 1]
        mixed = torch.einsum("hs,shd->hd", weights,
                             value[:at + 1, 0].double().repeat_interleave(2, dim=1))
        torch.testing.assert_close(mixed.flatten().float(), seen["out"][at, 0], atol=1e-5,
                                   rtol=1e-4)

    value_start, prompt_len = 8, 20
    examples = [NeedleExample(tuple(tokens[0, :21].tolist()), prompt_len, 5, 3, 1, 0.5)]
    hit = int(logits[prompt_len - 1].argmax()) == examples[0].answer[0]
    result = bench.needle_attention(model, examples)
    kind = "hit" if hit else "miss"
    assert result[kind]["examples"] == 1 and result["miss" if hit else "hit"]["mass"] is None
    layers = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    assert len(result[kind]["mass"]) == len(layers) and len(result[kind]["mass"][0]) == heads
    with torch.no_grad():
        model(tokens[:, :21], torch.arange(21)[None], None)
    want = bench.attention_row(*seen["args"][:2], core.softmax_scale, prompt_len - 1)
    assert abs(result[kind]["mass"][0][0] - float(want[0, value_start])) < 1e-9
    assert [b["examples"] for b in result["by_largest_mass"]] == [1]
