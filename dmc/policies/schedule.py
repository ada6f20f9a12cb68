"""When a KV policy compresses: its *schedule* (``KVPolicy.schedule`` and ``recompress_every``).

* ``"prefill"``: once, after the whole prompt has been prefilled (whatever the chunk size), so
  that an observation window sits at the end of the prompt, as SnapKV and PyramidKV define it;
  the decode phase then appends one slot per token, or re-compresses every ``every`` decode steps
  (``every=1``: after every generated token, as D2O generates). Between compressions the cache
  holds more than ``ceil(n / CR)`` slots: the memory CR is the one measured.
* ``"streaming"``: after every prefill chunk and every decode step, so that the cache never holds
  more than ``ceil(n / CR)`` slots per head after a forward (bounded memory in long prompts and
  long generations; H2O's and TOVA's per-step eviction, CAOTE's block-wise prefill).

A schedule is spelled ``prefill``, ``prefill/N`` (re-compress every ``N`` decode steps) or
``streaming`` (:meth:`Schedule.parse`).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("prefill", "streaming")


@dataclass(frozen=True)
class Schedule:
    """A compression schedule, checked when made.

    Args:
        kind: ``"prefill"`` or ``"streaming"``.
        every: with ``"prefill"``, re-compress every ``every`` decode steps (None: never).
    """

    kind: str
    every: int | None = None

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.kind!r}")
        if self.every is None:
            return
        if self.kind != "prefill":
            raise ValueError(f"recompress_every applies to schedule='prefill' only, got "
                             f"recompress_every={self.every!r} with schedule={self.kind!r}")
        if isinstance(self.every, bool) or int(self.every) != self.every or self.every < 1:
            raise ValueError(f"recompress_every must be an integer >= 1 or None, got "
                             f"{self.every!r}")
        object.__setattr__(self, "every", int(self.every))

    def due(self, *, decode: bool, prompt_end: bool, since: int) -> bool:
        """Whether a forward compresses a sequence: a decode step (``decode``) or a prefill chunk
        that ends the prompt (``prompt_end``) or not; ``since``: tokens since its last
        compression."""
        if self.kind == "streaming":
            return True
        if decode:
            return self.every is not None and since >= self.every
        return prompt_end

    @property
    def text(self) -> str:
        """The spelling :meth:`parse` reads."""
        return self.kind if self.every is None else f"{self.kind}/{self.every}"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """``prefill``, ``prefill/N`` or ``streaming``; ValueError naming the accepted ones."""
        kind, slash, every = text.strip().partition("/")
        number = None
        if slash:
            try:
                number = int(every)
            except ValueError:
                raise ValueError(f"schedule {text!r}: expected prefill, prefill/N (N >= 1 "
                                 f"decode steps) or streaming") from None
        return cls(kind, number)
