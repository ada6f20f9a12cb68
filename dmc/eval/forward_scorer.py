"""Teacher-forced scoring through a model's eval-mode forward, with no cache: the reference the
engine's compressed cache must reproduce (tests/eval/test_forward_scorer.py compares the two on
vanilla, DMC and delayed-merging DMC models, ``dmc.merge_delay``).

:class:`ForwardScorer` answers what :func:`dmc.eval.perplexity.evaluate_perplexity` and
:func:`dmc.eval.needle.evaluate_needle` ask of an :class:`dmc.inference.Engine`
(``score_batch``, ``max_batch``, ``chunk_size``, ``page_size``, ``dmc``). With causal attention
and hard decisions, the logits of a full forward at position ``i`` are those a cache would give
after tokens ``0 .. i`` (a test compares it with the engine on a DMC model), so prefilled and
teacher-forced tokens are scored alike. The cache it reports is the one an engine would hold
after the whole sequence: per (layer, KV head), the slots of Algorithm 1 over the tokens a
query no longer sees raw (all ``n`` of them, or ``n - d - 1`` under ``merge_delay`` = d: read
from the decision statistics of a forward over that prefix), on pages of ``page_size`` slots
with the engine's block-table and length metadata, the DMC merge state (its ring in the
dtype :func:`~dmc.inference.cache.merge_ring_dtype` gives, as the engine's), and under
``merge_delay`` a ring of the last d + 1 raw keys and values with their two decisions
(alpha, omega) in float32, counted as slots too.
"""
from __future__ import annotations

import contextlib

import torch

from dmc.inference.cache import merge_ring_dtype, open_slot_bytes
from dmc.inference.delayed_cache import delayed_ring_bytes
from dmc.inference.paging import pages_for
from dmc.inference.sequence import CompressionStats, ScoreResult


@contextlib.contextmanager
def eval_mode(model):
    """``model`` in eval mode and, for a DMC model, its runtime in ``eval`` mode (hard
    decisions: what the engine's cache computes); both restored on exit."""
    from dmc.megatron.attention import dmc_layers

    layers = dmc_layers(model)
    runtime = layers[0].dmc if layers else None
    mode, was_training = (runtime.mode if runtime else None), model.training
    model.eval()
    if runtime:
        runtime.set_mode("eval")
    try:
        yield
    finally:
        if runtime:
            runtime.set_mode(mode)
        model.train(was_training)


class ForwardScorer:
    """Scores token sequences with ``loaded.model``'s eval-mode forward, one at a time.

    Args:
        loaded: a :class:`dmc.inference.loading.LoadedModel` (vanilla, GQA or DMC; not DMS).
        max_batch: sequences per :meth:`score_batch` call (what callers batch by).
        page_size: the page size the reported cache bytes assume.
    """

    chunk_size = None  # no prefill chunks: one forward per sequence

    def __init__(self, loaded, max_batch: int = 8, page_size: int = 16):
        from dmc.megatron.attention import dmc_layers

        self.model = loaded.model
        self.dmc = loaded.dmc_config
        if self.dmc is not None and self.dmc.method != "dmc":
            raise ValueError(f"ForwardScorer: dmc.method={self.dmc.method!r} is not supported; "
                             f"score DMS models with the engine")
        self.max_batch, self.page_size = max_batch, page_size
        self.layers = dmc_layers(self.model)
        cfg = loaded.model_config
        self.shape = (cfg.num_layers, cfg.kv_heads)
        self.head_dim = cfg.head_dim
        param = next(self.model.parameters())
        self.device, self.dtype, self.item = param.device, param.dtype, param.element_size()

    @torch.inference_mode()
    def score_batch(self, sequences, *, return_logits: bool = False,
                    prefill_tokens=None) -> list[ScoreResult]:
        """``Engine.score_batch``'s results: ``token_logprobs [n - 1]`` float64, ``logits
        [n, vocab]`` float32 with ``return_logits``, the cache's compression and bytes.
        ``prefill_tokens`` is checked like the engine's and changes nothing else."""
        if len(sequences) > self.max_batch:
            raise ValueError(f"score_batch: {len(sequences)} sequences > max_batch="
                             f"{self.max_batch}")
        prefills = (prefill_tokens if isinstance(prefill_tokens, (list, tuple))
                    else [prefill_tokens] * len(sequences))
        results = []
        for tokens, prefill in zip(sequences, prefills):
            if prefill is not None and not 1 <= prefill <= len(tokens):
                raise ValueError(f"score: prefill_tokens must be None or in [1, {len(tokens)}], "
                                 f"got {prefill!r}")
            results.append(self._score(list(tokens), return_logits))
        return results

    def _score(self, tokens: list[int], return_logits: bool) -> ScoreResult:
        with eval_mode(self.model):
            self._reset_stats()
            logits = self._forward(tokens).float()
            slots = self._slots(tokens)
        logp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(tokens[1:], device=logits.device)[:, None]
        picked = logp.gather(-1, target)[:, 0].double().cpu()
        return ScoreResult(picked, logits.cpu() if return_logits else None,
                           CompressionStats(len(tokens), slots), self._bytes(slots))

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """``logits [len(tokens), vocab]`` of one eval-mode forward."""
        ids = torch.tensor(tokens, device=self.device)[None]
        return self.model(ids, torch.arange(len(tokens), device=self.device)[None], None)[0]

    def _reset_stats(self) -> None:
        for layer in self.layers:
            layer.reset_cr_stats()

    def _slots(self, tokens: list[int]) -> torch.Tensor:
        """Slots the cache holds per (layer, KV head) after ``tokens``: ``[layers, kv_heads]``
        long (see the module docstring), read from the decision statistics of the forward over
        all of them just run, or of one over the tokens no longer seen raw."""
        n = len(tokens)
        if self.dmc is None:
            return torch.full(self.shape, n, dtype=torch.long)
        raw = min(n, self.dmc.merge_delay + 1) if self.dmc.merge_delay else 0
        if raw == n:
            return torch.full(self.shape, n, dtype=torch.long)
        if raw:
            self._reset_stats()
            self._forward(tokens[:n - raw])
        merged = torch.stack([layer.cr_kept for layer in self.layers]).round().long().cpu()
        return merged + raw

    def _bytes(self, slots: torch.Tensor) -> dict:
        """What an engine's cache would hold for the sequence (see the module docstring)."""
        slot_bytes = 2 * self.head_dim * self.item
        heads = slots.numel()
        state = 0
        if self.dmc is not None:
            delay = self.dmc.merge_delay
            ring = merge_ring_dtype(self.dmc.window, delay, self.dtype)
            state = heads * open_slot_bytes(self.dmc.window or 1, self.head_dim, ring)
            if delay:
                slots = (slots - (delay + 1)).clamp_min(0)
                state += heads * delayed_ring_bytes(delay, self.head_dim, self.item)
        pages = int(pages_for(slots, self.page_size).sum())
        out = {"kv": pages * self.page_size * slot_bytes, "metadata": pages * 4 + heads * 4,
               "dmc_state": state, "policy_state": 0, "host": 0}
        out["total"] = out["kv"] + out["metadata"] + out["dmc_state"] + out["policy_state"]
        return out
