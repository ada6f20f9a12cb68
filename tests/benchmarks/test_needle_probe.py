"""benchmarks/needle_probe.py: a missed first value token is sorted by where the prediction
comes from (hand-worked prompt)."""
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
