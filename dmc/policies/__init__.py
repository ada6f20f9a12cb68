"""Training-free KV-cache policies on the paged cache: real eviction (pages freed), batched, per
KV head (GQA), when each policy's schedule says (:mod:`.schedule`: once after the prompt, or after
every prompt chunk and decode step; each paper's by default).

``get_policy(name, compression_ratio=2.0, **kwargs)`` builds one; pass it to
``dmc.inference.Engine(model, dmc=None, policy=...)``. Names: see ``POLICY_NAMES``. Where a policy
is named in a command line or an experiment file it is spelled ``NAME`` or ``NAME@SCHEDULE``
(:func:`parse_policy_spec`, :func:`policy_from_spec`).
"""
from __future__ import annotations

import inspect

from .adakv import AdaKV
from .base import KVPolicy, LayerView, PolicyShape, PolicyWrapper
from .caote import CAOTE, FastCAOTE
from .d2o import D2O
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .omnikv import OmniKV
from .pyramidkv import PyramidKV
from .random import Random
from .runner import PolicyRunner
from .schedule import SCHEDULES, Schedule
from .snapkv import SnapKV
from .streamingllm import StreamingLLM
from .tova import TOVA

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls
    for cls in (H2O, TOVA, SnapKV, StreamingLLM, PyramidKV, D2O, CAOTE, FastCAOTE, OmniKV,
                Random, KNorm, KeyDiff, AdaKV)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def get_policy(name: str, compression_ratio: float = 2.0, **policy_kwargs) -> KVPolicy:
    """A new policy ``name`` (one of ``POLICY_NAMES``) at ``compression_ratio``.

    Raises ValueError for an unknown name, an unknown keyword (listing the accepted ones) or a
    bad value."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid names: {list(POLICY_NAMES)}")
    cls = POLICIES[name]
    accepted = _keywords(cls)
    unknown = sorted(set(policy_kwargs) - set(accepted))
    if unknown and not (issubclass(cls, PolicyWrapper)
                        and _base_accepts(cls, policy_kwargs, unknown)):
        raise ValueError(f"policy {name!r} got unknown arguments {unknown}; accepted: "
                         f"{['compression_ratio'] + accepted}")
    return cls(compression_ratio, **policy_kwargs)


SPEC_SYNTAX = "NAME or NAME@SCHEDULE (SCHEDULE: prefill, prefill/N or streaming)"


def parse_policy_spec(text: str) -> tuple[str, dict]:
    """A policy as named in a command line or an experiment file: ``NAME`` (its paper's
    schedule) or ``NAME@SCHEDULE`` with ``SCHEDULE`` one of ``prefill``, ``prefill/N`` (re-compress
    every ``N`` decode steps) or ``streaming`` (:class:`Schedule`). Returns the name and the
    :func:`get_policy` keywords the spec sets; ValueError naming the field and the accepted
    values."""
    name, at, schedule = text.strip().lower().partition("@")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid names: {list(POLICY_NAMES)}")
    if not at:
        return name, {}
    plan = Schedule.parse(schedule)
    return name, {"schedule": plan.kind, "recompress_every": plan.every}


def policy_from_spec(text: str, compression_ratio: float = 2.0, **policy_kwargs) -> KVPolicy:
    """A new policy from a spec (:func:`parse_policy_spec`) at ``compression_ratio``."""
    name, kwargs = parse_policy_spec(text)
    return get_policy(name, compression_ratio, **kwargs, **policy_kwargs)


def _keywords(cls) -> list[str]:
    """Keyword-only options of ``cls`` (a wrapper's include :class:`PolicyWrapper`'s)."""
    inits = [cls.__init__] + ([PolicyWrapper.__init__] if issubclass(cls, PolicyWrapper) else [])
    params = [p for init in inits for p in inspect.signature(init).parameters.values()]
    return list(dict.fromkeys(p.name for p in params if p.kind == p.KEYWORD_ONLY))


def _base_accepts(cls: type[PolicyWrapper], kwargs: dict, unknown: list[str]) -> bool:
    """A wrapper (CAOTE, AdaKV) passes the keywords it does not know to its base policy: check
    them there."""
    base = kwargs.get("base") or cls.default_base
    if base not in cls.bases:
        raise ValueError(f"base must be one of {list(cls.bases)}, got {base!r}")
    accepted = _keywords(cls.bases[base])
    bad = [k for k in unknown if k not in accepted]
    if bad:
        raise ValueError(f"policy {cls.name} (base {base!r}) got unknown arguments {bad}; "
                         f"accepted: {['compression_ratio'] + _keywords(cls)} + {accepted}")
    return True


__all__ = [
    "CAOTE", "D2O", "H2O", "POLICIES", "POLICY_NAMES", "SCHEDULES", "SPEC_SYNTAX", "TOVA", "AdaKV",
    "FastCAOTE", "KNorm", "KVPolicy", "KeyDiff", "LayerView", "OmniKV", "PolicyRunner",
    "PolicyShape", "PolicyWrapper", "PyramidKV", "Random", "Schedule", "SnapKV", "StreamingLLM",
    "get_policy", "parse_policy_spec", "policy_from_spec",
]
