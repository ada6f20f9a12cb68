"""Needle-in-a-haystack retrieval built from any held-out token stream.

A *needle* (a ``key`` span followed by a ``value`` span, both cut from the corpus itself) is put
at a controlled depth of a haystack window of the same corpus; the prompt ends with the key
again and the model must continue with the value::

    tokens = hay[:p] + key + value + hay[p:] + key | value
             <----------------- prompt ------------>  <answer>

``p = round(depth * len(hay))``. Retrieval is then an induction-style copy (the key was seen
followed by the value), which even a tiny model trained for a few hundred steps can learn, so the
task separates caches that keep the needle from caches that dropped or blurred it (the "needle"
column of ``dmc eval compare``). Keys are re-drawn until they occur nowhere else in the prompt,
so the answer is unambiguous.

Generation is deterministic: the same stream, sizes and seed give the same examples.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_TRIES = 1000


@dataclass(frozen=True)
class NeedleExample:
    """One retrieval example.

    tokens: ``[seq_len]`` prompt then answer.
    prompt_len: the answer is ``tokens[prompt_len:]``.
    needle_start: the key starts at ``tokens[needle_start]``; the value follows it.
    key_len, value_len: span lengths. depth: where the needle sits in the haystack (0..1).
    """

    tokens: tuple[int, ...]
    prompt_len: int
    needle_start: int
    key_len: int
    value_len: int
    depth: float

    @property
    def prompt(self) -> list[int]:
        return list(self.tokens[:self.prompt_len])

    @property
    def answer(self) -> list[int]:
        return list(self.tokens[self.prompt_len:])

    @property
    def key(self) -> list[int]:
        return list(self.tokens[self.needle_start:self.needle_start + self.key_len])

    @property
    def value(self) -> list[int]:
        start = self.needle_start + self.key_len
        return list(self.tokens[start:start + self.value_len])


def _count(tokens: Sequence[int], span: Sequence[int]) -> int:
    """Occurrences of ``span`` in ``tokens`` (overlapping ones included)."""
    n, span = len(span), list(span)
    return sum(list(tokens[i:i + n]) == span for i in range(len(tokens) - n + 1))


def make_needle_examples(stream: Iterable[int], seq_len: int, num_examples: int, *,
                         depths: Sequence[float] = DEFAULT_DEPTHS, key_len: int = 8,
                         value_len: int = 4, seed: int = 0, exclude: Iterable[int] = (),
                         token_keys: bool = False) -> list[NeedleExample]:
    """``num_examples`` examples of ``seq_len`` tokens from a 1-D token ``stream``.

    Example ``i`` uses depth ``depths[i % len(depths)]`` and the ``i``-th non-overlapping
    haystack window of ``seq_len - 2 * (key_len + value_len)`` tokens; key and value are spans
    drawn (with ``seed``) from the rest of the stream, never holding an ``exclude`` token (e.g.
    the end-of-document id). ``token_keys`` draws the key's tokens one by one instead (as the
    random keys of passkey tasks: none of its n-grams is likelier to recur in the haystack than
    chance; a diagnostic, not the task). Raises ValueError naming the argument when the stream is
    too short or a size is out of range.
    """
    stream = [int(t) for t in stream]
    hay_len = seq_len - 2 * (key_len + value_len)
    if key_len < 1 or value_len < 1:
        raise ValueError(f"key_len and value_len must be >= 1, got {key_len}, {value_len}")
    if hay_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must exceed 2 * (key_len + value_len) = "
                         f"{2 * (key_len + value_len)}")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {list(depths)}")
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    needed = num_examples * hay_len
    if len(stream) < needed + key_len + value_len:
        raise ValueError(f"the token stream ({len(stream)} tokens) is too short for "
                         f"{num_examples} needle examples of seq_len {seq_len}: need at least "
                         f"{needed + key_len + value_len}")
    exclude = set(exclude)
    rng = random.Random(seed)
    examples = []
    for i in range(num_examples):
        taken = (i * hay_len, (i + 1) * hay_len)
        hay = stream[taken[0]:taken[1]]
        depth = float(depths[i % len(depths)])
        at = round(depth * hay_len)
        for _ in range(MAX_TRIES):
            key = ([_draw_span(stream, 1, taken, exclude, rng)[0] for _ in range(key_len)]
                   if token_keys else _draw_span(stream, key_len, taken, exclude, rng))
            value = _draw_span(stream, value_len, taken, exclude, rng)
            prompt = hay[:at] + key + value + hay[at:] + key
            if _count(prompt[:-1], key) == 1:  # the needle's key is the only earlier one
                break
        else:
            raise ValueError(f"could not draw an unambiguous needle in {MAX_TRIES} tries "
                             f"(stream of {len(stream)} tokens is too repetitive)")
        examples.append(NeedleExample(tuple(prompt + value), len(prompt), at, key_len,
                                      value_len, depth))
    return examples


def _draw_span(stream: list[int], length: int, taken: tuple[int, int], exclude: set,
               rng: random.Random) -> list[int]:
    """A random ``length``-token span of ``stream`` outside ``taken`` without ``exclude`` ids."""
    for _ in range(MAX_TRIES):
        start = rng.randrange(len(stream) - length + 1)
        span = stream[start:start + length]
        if (start + length <= taken[0] or start >= taken[1]) and not exclude.intersection(span):
            return span
    raise ValueError(f"could not draw a {length}-token span without {sorted(exclude)} outside "
                     f"the haystack in {MAX_TRIES} tries")
