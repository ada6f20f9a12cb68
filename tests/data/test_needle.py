"""Needle-in-a-haystack examples: deterministic, answer where they say, unambiguous key; keys
drawn token by token on request."""
import pytest

from dmc.data.needle import make_needle_examples


def stream(n=6000, vocab=50):
    """A repetitive pseudo-random stream (so the key check has work to do)."""
    x, out = 7, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2 ** 31
        out.append(x % vocab)
    return out


def test_layout_depth_and_answer_span():
    examples = make_needle_examples(stream(), 96, 5, depths=(0.0, 0.5, 1.0), key_len=6,
                                    value_len=3, seed=1)
    hay_len = 96 - 2 * (6 + 3)
    for i, ex in enumerate(examples):
        assert len(ex.tokens) == 96 and ex.prompt_len == 93
        assert ex.depth == (0.0, 0.5, 1.0)[i % 3]
        assert ex.needle_start == round(ex.depth * hay_len)
        assert ex.answer == ex.value and ex.prompt[-6:] == ex.key
        assert list(ex.tokens[ex.needle_start:ex.needle_start + 9]) == ex.key + ex.value
        hay = stream()[i * hay_len:(i + 1) * hay_len]
        rest = ex.prompt[:ex.needle_start] + ex.prompt[ex.needle_start + 9:-6]
        assert rest == hay  # the i-th haystack window, needle removed
        prompt = ex.prompt[:-1]
        hits = [j for j in range(len(prompt) - 5) if prompt[j:j + 6] == ex.key]
        assert hits == [ex.needle_start]  # the key occurs once before the query


def test_deterministic_by_seed_and_excludes_ids():
    a = make_needle_examples(stream(), 128, 4, seed=3, exclude={0, 1})
    assert a == make_needle_examples(stream(), 128, 4, seed=3, exclude={0, 1})
    assert a != make_needle_examples(stream(), 128, 4, seed=4, exclude={0, 1})
    assert all(not {0, 1} & set(ex.key + ex.value) for ex in a)


def test_token_keys_are_drawn_one_by_one():
    # a stream of consecutive ids: a span key is a run, a key drawn token by token is not
    run = list(range(5000))
    spans = make_needle_examples(run, 64, 6, key_len=6, seed=2)
    tokens = make_needle_examples(run, 64, 6, key_len=6, seed=2, token_keys=True)
    assert all(ex.key == list(range(ex.key[0], ex.key[0] + 6)) for ex in spans)
    assert all(ex.key != list(range(ex.key[0], ex.key[0] + 6)) for ex in tokens)
    assert [ex.tokens[:ex.needle_start] for ex in tokens] == \
        [ex.tokens[:ex.needle_start] for ex in spans]  # the same haystacks


@pytest.mark.parametrize("kwargs,message", [
    (dict(seq_len=20), r"seq_len \(20\) must exceed"),
    (dict(depths=(1.5,)), "depths must be fractions"),
    (dict(num_examples=0), "num_examples must be >= 1"),
    (dict(num_examples=500), "too short"),
])
def test_bad_arguments(kwargs, message):
    args = dict(seq_len=64, num_examples=2) | kwargs
    with pytest.raises(ValueError, match=message):
        make_needle_examples(stream(), args.pop("seq_len"), args.pop("num_examples"), **args)
