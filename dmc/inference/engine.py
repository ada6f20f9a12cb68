"""``Engine``: a megatron-core GPT model (vanilla, GQA or DMC) served with a paged per-head cache.

The engine reuses the model's own modules (``embedding``, each layer's ``input_layernorm``,
``linear_qkv`` split, ``linear_proj``, ``pre_mlp_layernorm``, ``mlp``, the final norm and the
output layer) and replaces only attention, which reads and writes a
:class:`~dmc.inference.cache.PagedKVCache`. TP = PP = 1.

DMC semantics are those of ``DMCSelfAttention`` in ``eval`` mode (whatever mode the model's runtime
is in): ``alpha_t = [k_t[-1] - c > 0]`` (``alpha_0 = 0``), ``omega_t = sigmoid(mean over the query
group of q_t[-1] + c) + omega_offset`` (:func:`dmc.ops.importance`), both channels zeroed before
and after RoPE, window-grouped (or exact) accumulation of pre-RoPE keys and values, RoPE at the
newest token's position, attention over slots (a slot is visible to later queries once closed;
the open slot is visible to the current query).

Prefill is exact and chunked: a prompt is processed ``chunk_size`` tokens at a time, each chunk
attending to the already-compressed cache plus itself under the hard-decision mask; the chunk is
then packed into the cache (:meth:`PagedKVCache.pack_prefill`). The open slot's pre-RoPE state
(the last ``window`` tokens, or the running mean and weight) is prepended to the next chunk so that
merges across chunk boundaries equal the full-sequence accumulation.

Decode is batched over sequences of any prompt length and any per-head cache length; sequences
finish independently (stop tokens, ``max_new_tokens``) and free their pages at once.

Out of pages, the engine **preempts**: when a decode step's layer needs more pages than are free,
the youngest running sequence (latest arrival) is freed and re-queued at the front; it restarts
later by re-prefilling its prompt plus the tokens it already generated (its sampler state is kept,
so its output is the same as without preemption). A sequence that cannot fit in the whole pool on
its own ends with ``finish_reason="cache_full"`` (and the tokens it generated); the other
requests complete.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from dmc.inference.cache import CacheFullError, PagedKVCache
from dmc.inference.sampling import SamplingParams, make_generator, sample_token
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.ops import zero_decision_channel
from dmc.ops.algorithm1 import compress_chunk, empty_prefix, hard_decisions, open_slot_prefix
from dmc.ops.mask import bias_from_log_keep, log_keep_next
from dmc.ops.rope import apply_rope

STATE_FORMAT = 1
MODEL_CONFIG_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                         "vocab_size")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- results
@dataclass
class CompressionStats:
    """Measured compression of the cache of one sequence (or of several, summed).

    tokens: tokens written into every (layer, KV head), summed over sequences.
    slots: ``[layers, kv_heads]`` slots kept, summed over sequences.
    CR = tokens / slots (per head), ``tokens * heads / sum(slots)`` per layer and overall.
    """

    tokens: int
    slots: torch.Tensor

    @property
    def overall(self) -> float:
        return _ratio(self.tokens * self.slots.numel(), int(self.slots.sum()))

    @property
    def per_layer(self) -> list[float]:
        heads = self.slots.shape[1]
        return [_ratio(self.tokens * heads, int(s)) for s in self.slots.sum(1)]

    @property
    def per_head(self) -> list[list[float]]:
        return [[_ratio(self.tokens, int(s)) for s in row] for row in self.slots]

    def __add__(self, other: CompressionStats) -> CompressionStats:
        return CompressionStats(self.tokens + other.tokens, self.slots + other.slots)

    @staticmethod
    def combine(stats: Iterable[CompressionStats]) -> CompressionStats:
        stats = list(stats)
        if not stats:
            raise ValueError("CompressionStats.combine needs at least one entry")
        total = stats[0]
        for s in stats[1:]:
            total = total + s
        return total

    def to_dict(self) -> dict:
        return {
            "cr": self.overall,
            "tokens": self.tokens,
            "slots": int(self.slots.sum()),
            "per_layer": self.per_layer,
            "per_head": self.per_head,
        }


def _ratio(tokens: int, slots: int) -> float:
    return tokens / slots if slots else 1.0


@dataclass
class GenerationResult:
    """A finished request.

    tokens: generated ids (the stop token included when one ended the request).
    finish_reason: ``"stop"`` (a stop token), ``"length"`` (``max_new_tokens``) or
        ``"cache_full"`` (the request alone outgrew the whole page pool: ``tokens`` holds what
        it generated before, ``error`` says why; the other requests are not affected).
    logprobs: log-probability of each generated token under the model (before temperature,
        top-k, top-p).
    compression: the cache at the end (prompt + generated tokens but the last, which was never
        fed back).
    kv_pages, kv_bytes: pages (and their K+V bytes) the sequence held at the end.
    preemptions: how many times it was preempted and restarted.
    """

    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    logprobs: list[float]
    compression: CompressionStats
    kv_pages: int
    kv_bytes: int
    preemptions: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["compression"] = self.compression.to_dict()
        return out


@dataclass
class ScoreResult:
    """Teacher-forced scoring of one token sequence (see :meth:`Engine.score`).

    token_logprobs: ``[n - 1]`` float64, ``log p(tokens[i + 1] | tokens[: i + 1])``.
    logits: ``[n, vocab]`` float32 when asked for, else None.
    compression: the cache after all ``n`` tokens (with a policy: the slots it kept, so CR is the
        measured one; OmniKV reports its GPU-resident slots, see :mod:`dmc.policies.omnikv`).
    cache_bytes: what the cache held for the sequence after all ``n`` tokens (see
        :meth:`Engine.sequence_bytes`).
    """

    token_logprobs: torch.Tensor
    logits: torch.Tensor | None
    compression: CompressionStats
    cache_bytes: dict = field(default_factory=dict)


@dataclass
class _Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int | None = None
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class _Scorer:
    """One sequence of :meth:`Engine.score_batch`: its tokens, and the log-probabilities (and
    logits) gathered from prefill chunks and decode steps."""

    def __init__(self, tokens: list[int], prefilled: int | None, max_seq_len: int,
                 device: torch.device, keep_logits: bool):
        if len(tokens) < 1 or len(tokens) > max_seq_len:
            raise ValueError(f"score: need 1..{max_seq_len} tokens, got {len(tokens)}")
        self.prefilled = len(tokens) if prefilled is None else int(prefilled)
        if not 1 <= self.prefilled <= len(tokens):
            raise ValueError(f"score: prefill_tokens must be None or in [1, {len(tokens)}], got "
                             f"{prefilled!r}")
        self.tokens = tokens
        self.target = torch.tensor(tokens[1:] + [0], device=device)
        self.keep_logits = keep_logits
        self.logprobs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.seq: _Sequence | None = None

    def consume(self, start: int, logits: torch.Tensor) -> None:
        """``logits [n, vocab]`` of the positions ``start .. start + n - 1``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, self.target[start:start + logits.shape[0], None])[:, 0]
        self.logprobs.append(picked.double().cpu())
        if self.keep_logits:
            self.logits.append(logits.float().cpu())

    def result(self, compression: CompressionStats, cache_bytes: dict) -> ScoreResult:
        return ScoreResult(torch.cat(self.logprobs)[:-1],
                           torch.cat(self.logits) if self.keep_logits else None,
                           compression, cache_bytes)


# ----------------------------------------------------------------------------- engine
class Engine:
    """Chunked-prefill, batched-decode generation with a paged (DMC-compressed) KV cache.

    Args:
        model: a megatron-core ``GPTModel`` from :func:`dmc.megatron.model.build_gpt_model`
            (TP = PP = 1, RoPE). The engine puts it in ``eval()`` mode and runs it under
            ``torch.inference_mode``.
        dmc: ``"auto"`` (DMC semantics when the model has ``DMCSelfAttention`` layers, with their
            runtime's config), a :class:`DMCRuntime` or :class:`DMCConfig` (DMC semantics with
            these ``c`` and ``window``, whatever the attention modules are), or ``None``
            (vanilla attention).
        num_pages: pages in the pool; default: room for ``max_batch`` uncompressed sequences of
            ``max_seq_len`` tokens, capped by ``kv_cache_bytes``.
        kv_cache_bytes: byte budget of the page pool (keys and values) when ``num_pages`` is not
            given; default: 90% of the free GPU memory on CUDA, a quarter of the RAM on CPU.
        page_size: slots per page.
        max_batch: most sequences running at once (= cache sequence slots).
        max_seq_len: most tokens (prompt + generated) per sequence; default: the model's
            ``max_sequence_length``.
        chunk_size: prefill chunk in tokens.
        cache_dtype: dtype of the page pools; default: the model's parameter dtype.
        use_triton: kernel choice (None: Triton on CUDA, PyTorch on CPU).
        seed: base seed of requests that set none (request ``i`` uses ``seed + i``).
        policy: a training-free KV policy from :func:`dmc.policies.get_policy` (vanilla or GQA
            models only): it evicts after every prefill chunk and decode step, freeing pages.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        dmc: DMCRuntime | DMCConfig | str | None = "auto",
        *,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        chunk_size: int = 512,
        cache_dtype: torch.dtype | None = None,
        use_triton: bool | None = None,
        seed: int = 0,
        policy=None,
    ):
        from megatron.core import parallel_state

        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise ValueError("Engine supports tensor_parallel = pipeline_parallel = 1 only")
        if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
            raise ValueError("Engine needs a whole model (pre_process and post_process)")
        if chunk_size < 1 or max_batch < 1 or page_size < 1:
            raise ValueError("chunk_size, max_batch and page_size must be >= 1")
        self.model = model.eval()
        self.config = model.config
        self.layers = list(model.decoder.layers)
        self.dmc = _resolve_dmc(self.layers, dmc)
        attn = self.layers[0].self_attention
        self.num_layers = len(self.layers)
        self.num_heads = attn.num_attention_heads_per_partition
        self.num_kv_heads = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.config.softmax_scale or self.head_dim ** -0.5
        self.inv_freq = _rope_inv_freq(model, self.head_dim)
        if self.config.apply_residual_connection_post_layernorm:
            raise ValueError("Engine supports pre-norm residuals only")

        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_seq_len = int(max_seq_len or model.max_sequence_length)
        self.page_size, self.max_batch, self.chunk_size = page_size, max_batch, chunk_size
        if num_pages is None:
            num_pages = self._default_num_pages(kv_cache_bytes, cache_dtype or self.dtype)
        self.cache = PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, num_pages, page_size=page_size,
            max_seqs=max_batch, window=self.dmc.window if self.dmc else None,
            dtype=cache_dtype or self.dtype, device=self.device, max_seq_len=self.max_seq_len,
        )
        self.cache.inv_freq = self.inv_freq.clone()
        self.policy = None  # a dmc.policies.PolicyRunner
        if policy is not None:
            from dmc.policies import PolicyRunner

            if self.dmc is not None:
                raise ValueError("Engine: policy is not supported on a DMC model (dmc must be "
                                 "None for a vanilla or GQA model)")
            self.policy = PolicyRunner(policy, self.cache, self.num_heads, self.scale)
        self.use_triton = use_triton
        self.seed = seed
        self._next_id = 0
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._unclaimed: list[GenerationResult] = []
        self._dropped: list[GenerationResult] = []  # cache_full results of the decode step
        self._blocked_at: int | None = None  # free pages when a prefill last ran out
        self._seen = [0, 0]  # token-head entries and slots of prefilled sequences (CR estimate)
        self.reset_stats()

    # ------------------------------------------------------------------ construction
    def _default_num_pages(self, budget: int | None, dtype: torch.dtype) -> int:
        """Room for ``max_batch`` uncompressed sequences, within ``budget`` bytes (default: 90%
        of the free CUDA memory, or a quarter of the host RAM)."""
        full = (self.max_batch * math.ceil(self.max_seq_len / self.page_size)
                * self.num_layers * self.num_kv_heads)
        if budget is None:
            if self.device.type == "cuda":
                budget = int(0.9 * torch.cuda.mem_get_info(self.device)[0])
            else:
                import psutil

                budget = psutil.virtual_memory().total // 4
        page_bytes = 2 * self.page_size * self.head_dim * torch.empty((), dtype=dtype).element_size()
        pages = min(full, budget // page_bytes)
        if pages < 1:
            raise ValueError(f"kv_cache_bytes={budget} holds no page of {page_bytes} bytes")
        return pages

    @classmethod
    def from_state_dict(cls, state_dict: dict, model_config: dict,
                        dmc_config: DMCConfig | dict | None = None, **engine_kwargs) -> Engine:
        """Build the model from ``model_config`` (see :func:`build_model_from_config`), load
        ``state_dict`` into it and wrap it; ``dmc_config`` None = a vanilla model."""
        from dmc.inference.loading import _load_plain

        model = build_model_from_config(model_config, dmc_config)
        _load_plain(model, state_dict, "state_dict")
        return cls(model, **engine_kwargs)

    @classmethod
    def from_path(cls, path, **engine_kwargs) -> Engine:
        """An engine for the model at ``path``: an inference ``.pt`` file, a training checkpoint
        folder (any TP/PP), a checkpoints folder or a run folder (its latest checkpoint); see
        :func:`dmc.inference.loading.load_model`."""
        from dmc.inference.loading import load_model

        return cls(load_model(path).model, **engine_kwargs)

    @classmethod
    def from_file(cls, path, **engine_kwargs) -> Engine:
        """An engine from a file written by :func:`save_inference_state`."""
        saved = load_inference_state(path)
        return cls.from_state_dict(saved["state_dict"], saved["model_config"],
                                   saved["dmc_config"], **engine_kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids); returns its request id (arrival order)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("add_request: the prompt must hold at least one token")
        longest = len(prompt) + params.max_new_tokens - 1
        if longest > self.max_seq_len:
            raise ValueError(
                f"add_request: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens})"
                f" - 1 = {longest} tokens exceed max_seq_len = {self.max_seq_len}"
            )
        vocab = self.model.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"add_request: token ids must be in [0, {vocab})")
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else self.seed + request_id
        generator = None if params.greedy else make_generator(seed)
        self._waiting.append(_Sequence(request_id, prompt, params, generator))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[GenerationResult]:
        """Admit (prefill) waiting requests while they fit, then one decode step for every
        running sequence. Returns the requests that finished during this step (and those of
        requests queued with :meth:`add_request` that finished inside :meth:`generate`)."""
        finished, self._unclaimed = self._unclaimed, []
        with torch.inference_mode():
            self._admit(finished)
            if self._running:
                self._sync()
                started = time.perf_counter()
                self._decode(list(self._running), finished)
                self._sync()
                self.stats["decode_seconds"] += time.perf_counter() - started
                self.stats["decode_steps"] += 1
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (continuous batching); results in prompt order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per prompt;
        ``progress`` shows a tqdm bar over generated tokens (of all running requests). Requests
        queued earlier with :meth:`add_request` run alongside; their results come from the next
        :meth:`step`.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        budget = {i: sp.max_new_tokens for i, sp in zip(ids, params)}
        results: dict[int, GenerationResult] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(budget.values()), unit="tok", desc="generate")
        wanted = set(ids)
        while wanted - results.keys():
            if not self.has_unfinished():
                raise RuntimeError("generate: requests vanished from the engine")
            before = self.stats["generated_tokens"]
            for result in self.step():
                if result.request_id not in wanted:  # queued by add_request: next step()
                    self._unclaimed.append(result)
                    continue
                results[result.request_id] = result
                if bar is not None:  # a stop token ends a request early: count its rest as done
                    bar.update(budget[result.request_id] - len(result.tokens))
            if bar is not None:
                bar.update(self.stats["generated_tokens"] - before)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def score(self, tokens: Sequence[int], *, return_logits: bool = False,
              prefill_tokens: int | None = None) -> ScoreResult:
        """Teacher forcing through the real compressed cache: the log-probability of every next
        token. The first ``prefill_tokens`` tokens (None: all) go through chunked prefill, the
        others one at a time through the decode path, so that a policy evicts at every token as
        in generation (DMC and vanilla give the same result either way). Uses one sequence slot
        and its pages for the duration of the call (no preemption: :class:`CacheFullError` when
        they do not fit). :meth:`score_batch` scores several sequences at once."""
        return self.score_batch([tokens], return_logits=return_logits,
                                prefill_tokens=prefill_tokens)[0]

    @torch.inference_mode()
    def score_batch(self, sequences: Sequence[Sequence[int]], *, return_logits: bool = False,
                    prefill_tokens: int | Sequence[int | None] | None = None
                    ) -> list[ScoreResult]:
        """:meth:`score` for several sequences: each is prefilled on its own, then their
        teacher-forced tokens are decoded as one batch (a sequence leaves the batch when its
        tokens run out). ``prefill_tokens`` is one value for all or one per sequence. At most
        ``max_batch`` sequences (the cache's sequence slots)."""
        sequences = [[int(t) for t in seq] for seq in sequences]
        if not 1 <= len(sequences) <= self.max_batch:
            raise ValueError(f"score_batch: need 1..{self.max_batch} (max_batch) sequences, "
                             f"got {len(sequences)}")
        if prefill_tokens is None or isinstance(prefill_tokens, int):
            prefill_tokens = [prefill_tokens] * len(sequences)
        if len(prefill_tokens) != len(sequences):
            raise ValueError(f"score_batch: {len(sequences)} sequences but "
                             f"{len(prefill_tokens)} prefill_tokens")
        scorers = [_Scorer(tokens, prefilled, self.max_seq_len, self.device, return_logits)
                   for tokens, prefilled in zip(sequences, prefill_tokens)]
        running = []
        try:
            for scorer in scorers:
                slot = self.cache.add_sequence()
                scorer.seq = _Sequence(-1, scorer.tokens[:scorer.prefilled], SamplingParams(),
                                       None, slot=slot)
                running.append(scorer)
                self._prefill(slot, scorer.seq.tokens, scorer.consume, all_logits=True)
            position = min(s.prefilled for s in scorers)
            while active := [s for s in scorers if s.prefilled <= position < len(s.tokens)]:
                _, logits = self._decode_step([s.seq for s in active],
                                              [s.tokens[position] for s in active],
                                              [position] * len(active), preempt=False)
                for scorer, row in zip(active, logits):
                    scorer.consume(position, row[None])
                position += 1
            results = []
            for scorer in scorers:
                slot = scorer.seq.slot
                results.append(scorer.result(self._compression(slot, len(scorer.tokens)),
                                             self.sequence_bytes(slot)))
        finally:
            for scorer in running:
                self.cache.free_sequence(scorer.seq.slot)
        return results

    def sequence_bytes(self, slot: int) -> dict:
        """Bytes the cache holds for the sequence in ``slot``: its pages (``kv``), their block
        table entries and per-head lengths (``metadata``), the DMC merge state of every head
        (``dmc_state``: the window ring or running mean in float32, its weights and count) and a
        policy's per-slot and per-sequence state (``policy_state``); ``total`` sums them."""
        out = self.cache.sequence_bytes(slot, dmc_state=self.dmc is not None)
        out["policy_state"] = self.policy.state_bytes(slot) if self.policy is not None else 0
        out["total"] = sum(out.values())
        return out

    def reset_stats(self) -> None:
        """Zero the counters in ``self.stats``."""
        self.stats = {
            "prefill_tokens": 0, "prefill_seconds": 0.0, "decode_steps": 0,
            "decode_tokens": 0, "decode_seconds": 0.0, "generated_tokens": 0,
            "preemptions": 0, "peak_running": 0, "peak_pages": 0,
        }

    # ------------------------------------------------------------------ scheduling
    def _admit(self, finished: list[GenerationResult]) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            if self._running:
                if self._blocked_at is not None and self.cache.free_pages <= self._blocked_at:
                    return
                reserve = self.num_layers * self.num_kv_heads
                if self._estimate_pages(len(seq.tokens)) + reserve > self.cache.free_pages:
                    return
            self._waiting.pop(0)
            seq.slot = self.cache.add_sequence()
            last = []
            self._sync()
            started = time.perf_counter()
            try:
                self._prefill(seq.slot, seq.tokens, lambda start, logits: last.append(logits))
            except CacheFullError:
                if not self._running:
                    finished.append(self._fail(
                        seq, f"request {seq.request_id}: {len(seq.tokens)} tokens do not fit "
                             f"in the whole pool ({self.cache.num_pages} pages of "
                             f"{self.page_size} slots)"))
                    continue
                self.cache.free_sequence(seq.slot)
                seq.slot = None
                self._waiting.insert(0, seq)
                self._blocked_at = self.cache.free_pages
                return
            finally:
                self._sync()
                self.stats["prefill_seconds"] += time.perf_counter() - started
            self.stats["prefill_tokens"] += len(seq.tokens)
            self._blocked_at = None
            self._running.append(seq)
            self._note_usage()
            lengths = self.cache.head_lengths(seq.slot)
            self._seen[0] += len(seq.tokens) * lengths.numel()
            self._seen[1] += int(lengths.sum())
            self._accept([seq], last[-1][-1:], finished)

    def _estimate_pages(self, tokens: int) -> int:
        """Pages a prompt of ``tokens`` is expected to take, at the CR seen so far."""
        cr = self._seen[0] / self._seen[1] if self._seen[1] else 1.0
        per_head = math.ceil(tokens / cr / self.page_size)
        return per_head * self.num_layers * self.num_kv_heads

    def _preempt(self, seq: _Sequence) -> None:
        """Free ``seq``'s pages and put it back at the front of the queue (arrival order)."""
        self.cache.free_sequence(seq.slot)
        seq.slot = None
        seq.preemptions += 1
        self.stats["preemptions"] += 1
        self._running.remove(seq)
        self._waiting.append(seq)
        self._waiting.sort(key=lambda s: s.request_id)

    def _accept(self, seqs: list[_Sequence], logits: torch.Tensor,
                finished: list[GenerationResult]) -> None:
        """Sample the next token of each sequence from ``logits [batch, vocab]``."""
        greedy = torch.argmax(logits, dim=-1).tolist()
        chosen = [greedy[i] if seq.params.greedy else sample_token(logits[i], seq.params,
                                                                    seq.generator)
                  for i, seq in enumerate(seqs)]
        picked = torch.tensor(chosen, device=logits.device)[:, None]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, picked)[:, 0].tolist()
        for seq, token, token_logp in zip(seqs, chosen, logp):
            seq.generated.append(token)
            seq.logprobs.append(token_logp)
            self.stats["generated_tokens"] += 1
            if token in seq.params.stop_tokens:
                finished.append(self._finish(seq, "stop"))
            elif len(seq.generated) >= seq.params.max_new_tokens:
                finished.append(self._finish(seq, "length"))

    def _finish(self, seq: _Sequence, reason: str) -> GenerationResult:
        lengths = self.cache.head_lengths(seq.slot).long()
        pages = int(((lengths + self.page_size - 1) // self.page_size).sum())
        compression = self._compression(seq.slot, len(seq.tokens) - 1)
        self.cache.free_sequence(seq.slot)
        self._running.remove(seq)
        return GenerationResult(
            seq.request_id, seq.prompt, list(seq.generated), reason, list(seq.logprobs),
            compression, pages, pages * self.cache.page_bytes, seq.preemptions,
        )

    def _fail(self, seq: _Sequence, error: str) -> GenerationResult:
        """Ends ``seq`` (running or being admitted) with ``finish_reason="cache_full"``."""
        zero = torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.long)
        self.cache.free_sequence(seq.slot)
        seq.slot = None
        if seq in self._running:
            self._running.remove(seq)
        return GenerationResult(
            seq.request_id, seq.prompt, list(seq.generated), "cache_full", list(seq.logprobs),
            CompressionStats(0, zero), 0, 0, seq.preemptions, error,
        )

    def _compression(self, slot: int, tokens: int) -> CompressionStats:
        if self.policy is not None:
            return CompressionStats(tokens, self.policy.reported_slots(slot, tokens))
        return CompressionStats(tokens, self.cache.head_lengths(slot).long())

    def _note_usage(self) -> None:
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self._running))
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.cache.pages_in_use)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ model pieces
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens [batch, seq] -> [seq, batch, hidden]``."""
        return self.model.embedding(input_ids=tokens, position_ids=positions)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[seq, batch, hidden] -> [seq, batch, vocab]`` (final norm and output layer)."""
        hidden = self.model.decoder.final_layernorm(hidden)
        weight = None
        if self.model.share_embeddings_and_output_weights:
            weight = self.model.shared_embedding_or_output_weight()
        logits, _ = self.model.output_layer(hidden, weight=weight)
        return logits

    def _qkv(self, layer, hidden):
        """``[seq, batch, hidden] ->`` q ``[seq, batch, heads, dim]``, k and v
        ``[seq, batch, kv_heads, dim]`` (megatron's split; zero_out scaling is a forward-only
        matter of ``DMCSelfAttention``)."""
        return layer.self_attention.get_query_key_value_tensors(hidden)

    def _finish_layer(self, layer, x, context):
        """Output projection, residual, MLP block. ``context [seq, batch, heads * dim]``."""
        out, bias = layer.self_attention.linear_proj(context.to(x.dtype))
        x = x + out if bias is None else x + out + bias
        out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
        return x + out if bias is None else x + out + bias

    # ------------------------------------------------------------------ prefill
    def _prefill(self, slot: int, tokens: list[int],
                 consume: Callable[[int, torch.Tensor], None], all_logits: bool = False) -> None:
        """Exact chunked prefill of ``tokens`` into sequence ``slot`` (empty). ``consume(start,
        logits [n, vocab])`` receives the logits of every chunk (``all_logits``) or of the last
        token only."""
        total = len(tokens)
        ids = torch.tensor(tokens, device=self.device)
        if self.policy is not None:
            self.policy.reset(slot)
        for start in range(0, total, self.chunk_size):
            end = min(start + self.chunk_size, total)
            positions = torch.arange(start, end, device=self.device)
            x = self._embed(ids[None, start:end], positions[None])
            for index, layer in enumerate(self.layers):
                x = self._prefill_layer(index, layer, x, slot, start)
            if self.policy is not None:
                self.policy.evict([slot], [end])
            if all_logits:
                consume(start, self._logits(x)[:, 0])
            elif end == total:
                consume(end - 1, self._logits(x[-1:])[:, 0])

    def _prefill_layer(self, index, layer, x, slot, start):
        n = x.shape[0]
        query, key, value = self._qkv(layer, layer.input_layernorm(x))
        query, key, value = query[:, 0], key[:, 0], value[:, 0]  # [n, heads, dim]
        positions = torch.arange(start, start + n, device=self.device)
        lengths = self.cache.head_lengths(slot)[index].long()  # host [kv_heads]
        heads = self.num_kv_heads
        if self.dmc is None:
            keys = apply_rope(key.float().transpose(0, 1), positions, self.inv_freq)  # [kv, n, d]
            values = value.float().transpose(0, 1)
            chunk_bias = bias_from_log_keep(keys.new_zeros(heads, n))  # causal
            visible = self._slot_mask(lengths)
            rows = torch.zeros(heads, 1, self.head_dim, device=self.device)
            packed = (torch.full((heads,), n), keys, values)
            open_state = (rows, rows, rows[..., 0], torch.zeros(heads, dtype=torch.long))
            overwrite = None
        else:
            decided = hard_decisions(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                     self.dmc.c, self.dmc.omega_offset)
            query = decided.query[0].transpose(0, 1)
            alpha = decided.alpha
            if start == 0:
                alpha[..., 0] = 0
            prefix = (empty_prefix(1, heads, self.head_dim, self.device) if start == 0 else
                      open_slot_prefix(self.cache.open_state(index, [slot]), self.dmc.window))
            chunk = compress_chunk(decided.key, value.transpose(0, 1)[None], alpha, decided.omega,
                                   positions, self.inv_freq, self.dmc.window, prefix)
            alpha = alpha[0]
            keys, values = chunk.keys[0], chunk.values[0]
            chunk_bias = bias_from_log_keep(log_keep_next(alpha))
            overwrite = (alpha[:, 0] > 0.5) if start else None  # first token merges: open slot
            visible = self._slot_mask(lengths, None if overwrite is None else overwrite.cpu())
            packed = (chunk.counts[0].cpu(), chunk.slot_keys[0], chunk.slot_values[0])
            open_state = tuple(x[0] for x in chunk.open)
        q_rot = apply_rope(query.float().transpose(0, 1), positions, self.inv_freq)  # [h, n, d]
        if self.dmc is not None:
            q_rot = zero_decision_channel(q_rot)
        context = self._chunk_attention(slot, index, lengths, visible, q_rot, keys, values,
                                        chunk_bias)
        self.cache.pack_prefill(index, slot, packed[1], packed[2], packed[0], *open_state,
                                overwrite_last=overwrite)
        if self.policy is not None:
            self.policy.observe(index, [slot], q_rot[None], positions[None], prefill=True)
        context = context.transpose(0, 1).reshape(n, 1, self.num_heads * self.head_dim)
        return self._finish_layer(layer, x, context)

    def _slot_mask(self, lengths, hide_last=None):
        """``[kv, max_len]`` visibility of the cached slots to a chunk's queries: all of a head's
        slots, but its last (open) one when the chunk's first token merges into it."""
        max_len = int(lengths.max()) if lengths.numel() else 0
        slots = torch.arange(max_len)
        visible = slots[None] < lengths[:, None]
        if hide_last is not None:
            visible &= ~((slots[None] == lengths[:, None] - 1) & hide_last[:, None])
        return visible.to(self.device)

    def _chunk_attention(self, slot, index, lengths, visible, query, keys, values, chunk_bias):
        """Attention of chunk queries ``[heads, n, dim]`` over the cached slots (``visible``) and
        the chunk's own slots (``keys, values [kv, n, dim]``, additive ``chunk_bias [kv, n, n]``).
        Returns ``[heads, n, dim]`` float32."""
        kv, n, dim = keys.shape
        max_len = visible.shape[1]
        if max_len:
            slots = torch.arange(max_len, device=self.device)
            valid = slots[None] < lengths.to(self.device)[:, None]
            table = self.cache.block_tables[slot, index].long()
            pages = torch.where(valid, table[:, slots // self.page_size], 0)
            offsets = (slots % self.page_size).expand_as(pages)
            cached_k = self.cache.k_pages[pages, offsets].float()
            cached_v = self.cache.v_pages[pages, offsets].float()
            keys = torch.cat([cached_k, keys], dim=1)
            values = torch.cat([cached_v, values], dim=1)
            cache_bias = torch.zeros(visible.shape, device=self.device).masked_fill(
                ~visible, float("-inf"))
            chunk_bias = torch.cat([cache_bias[:, None].expand(kv, n, max_len), chunk_bias], -1)
        q = query.reshape(kv, self.group, n, dim)
        scores = torch.einsum("hgnd,hsd->hgns", q, keys) * self.scale + chunk_bias[:, None]
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hgns,hsd->hgnd", probs, values).reshape(kv * self.group, n, dim)

    # ------------------------------------------------------------------ decode
    def _decode(self, batch: list[_Sequence], finished: list[GenerationResult]) -> None:
        """One token for every sequence of ``batch`` (each feeds its newest token)."""
        batch, logits = self._decode_step(batch, [s.tokens[-1] for s in batch],
                                          [len(s.tokens) - 1 for s in batch])
        finished.extend(self._dropped)
        self._dropped.clear()
        if not batch:
            return
        self._note_usage()
        self.stats["decode_tokens"] += len(batch)
        self._accept(batch, logits, finished)

    def _decode_step(self, batch: list[_Sequence], tokens: list[int], positions: list[int],
                     preempt: bool = True):
        """Feed ``tokens`` (one per sequence, at ``positions``) through every layer; returns the
        sequences still running (``preempt``: the youngest make room when pages run out) and
        their logits ``[batch, vocab]``."""
        tokens = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor(positions)
        x = self._embed(tokens, positions[:, None].to(self.device))  # [1, batch, hidden]
        lengths = torch.stack([self.cache.head_lengths(s.slot) for s in batch]).long()
        for index, layer in enumerate(self.layers):
            query, key, value = self._qkv(layer, layer.input_layernorm(x))
            query, key, value = query[0], key[0], value[0]  # [batch, heads, dim]
            if self.dmc is None:
                alpha = omega = None
                appends = torch.ones(len(batch), self.num_kv_heads, dtype=torch.bool)
            else:
                decided = hard_decisions(query[:, :, None], key[:, :, None], self.dmc.c,
                                         self.dmc.omega_offset)
                query, key = decided.query[:, :, 0], decided.key[:, :, 0]
                alpha, omega = decided.alpha[..., 0], decided.omega[..., 0]
                appends = alpha.cpu() <= 0.5
            keep = self._make_room(batch, lengths[:, index], appends) if preempt else None
            if keep == []:  # a lone sequence outgrew the pool and was dropped
                return [], None
            if keep is not None:  # some sequences were preempted
                batch = [batch[i] for i in keep]
                rows = torch.tensor(keep)
                positions, lengths = positions[rows], lengths[rows]
                rows = rows.to(self.device)
                x, query, key, value = x[:, rows], query[rows], key[rows], value[rows]
                if alpha is not None:
                    alpha, omega = alpha[rows], omega[rows]
            slots = [s.slot for s in batch]
            pos = positions.to(self.device)
            if self.dmc is None:
                rotated = apply_rope(key.float(), pos[:, None], self.inv_freq)
                self.cache.append(index, slots, rotated, value)
            else:
                self.cache.write(index, slots, pos, key, value, omega, alpha,
                                 use_triton=self.use_triton)
            q_rot = apply_rope(query.float(), pos[:, None], self.inv_freq)
            if self.dmc is not None:
                q_rot = zero_decision_channel(q_rot)
            context = None
            if self.policy is not None:
                context = self.policy.decode_attention(index, slots, q_rot)
            if context is None:
                context = self.cache.attention(index, slots, q_rot, self.scale,
                                               use_triton=self.use_triton)
            if self.policy is not None:
                self.policy.observe(index, slots, q_rot[:, :, None], pos[:, None], prefill=False)
            x = self._finish_layer(layer, x, context.reshape(1, len(batch), -1))
        if self.policy is not None:
            self.policy.evict([s.slot for s in batch], positions + 1)
        return batch, self._logits(x)[0]

    def _make_room(self, batch, lengths, appends):
        """Preempt the youngest sequences of ``batch`` until one layer's writes fit.

        ``lengths [batch, kv]`` are the heads' slots before the write, ``appends [batch, kv]``
        which heads open a slot. Returns None when all fit, else the kept batch indices (empty
        when a lone sequence does not fit: it ends with ``finish_reason="cache_full"``)."""
        new_page = (appends | (lengths == 0)) & (lengths % self.page_size == 0)
        needed = new_page.sum(dim=1)
        keep = list(range(len(batch)))
        if int(needed.sum()) <= self.cache.free_pages:
            return None
        while int(needed[keep].sum()) > self.cache.free_pages:
            if len(keep) == 1:
                seq = batch[keep[0]]
                self._dropped.append(self._fail(
                    seq, f"request {seq.request_id} alone needs more than the whole pool "
                         f"({self.cache.num_pages} pages of {self.page_size} slots) after "
                         f"{len(seq.tokens)} tokens"))
                return []
            youngest = max(keep, key=lambda i: batch[i].request_id)
            keep.remove(youngest)
            self._preempt(batch[youngest])
        return keep


# ----------------------------------------------------------------------------- helpers
def _resolve_dmc(layers, dmc) -> DMCConfig | None:
    if isinstance(dmc, str):
        if dmc != "auto":
            raise ValueError(f"Engine: dmc must be 'auto', a DMCRuntime, a DMCConfig or None, "
                             f"got {dmc!r}")
        runtimes = [getattr(layer.self_attention, "dmc", None) for layer in layers]
        runtimes = [r for r in runtimes if isinstance(r, DMCRuntime)]
        return runtimes[0].config if runtimes else None
    if dmc is None or isinstance(dmc, DMCConfig):
        return dmc
    if isinstance(dmc, DMCRuntime):
        return dmc.config
    raise TypeError(f"Engine: dmc must be 'auto', a DMCRuntime, a DMCConfig or None, got {dmc!r}")


def _rope_inv_freq(model, head_dim: int) -> torch.Tensor:
    """The model's RoPE frequencies ``[head_dim // 2]`` (float32), checked to be plain
    full-dimension rotate-half RoPE."""
    rope = getattr(model, "rotary_pos_emb", None)
    if getattr(model, "position_embedding_type", None) != "rope" or rope is None:
        raise ValueError("Engine supports RoPE models only (position_embedding_type='rope')")
    if rope.rotary_interleaved or rope.seq_len_interpolation_factor is not None:
        raise ValueError("Engine supports rotate-half RoPE without position interpolation only")
    inv_freq = rope.inv_freq.float()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"Engine needs RoPE over the whole head (rotary_percent=1): "
                         f"{inv_freq.numel()} frequencies for head_dim {head_dim}")
    device = next(model.parameters()).device
    return inv_freq.to(device)


# ----------------------------------------------------------------------------- model files
def build_model_from_config(model_config: dict, dmc_config: DMCConfig | dict | None = None):
    """A megatron ``GPTModel`` (TP = PP = 1) from a plain dict of hyper-parameters.

    ``model_config`` keys: ``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``ffn_hidden_size``, ``vocab_size`` (required); ``num_query_groups`` (default: heads),
    ``max_seq_length`` (4096), ``norm_epsilon`` (1e-5), ``rotary_base`` (10000.0),
    ``share_embeddings`` (False), ``rope_scaling_factor`` (None: Llama 3.x RoPE scaling off),
    ``params_dtype`` ("float32", "bfloat16" or "float16");
    any other key is passed to :func:`dmc.megatron.model.llama_transformer_config` as a
    ``TransformerConfig`` override (e.g. ``add_qkv_bias``). ``dmc_config`` (a
    :class:`DMCConfig` or its fields as a dict) makes a DMC model; None a vanilla one.
    Initialises megatron's parallel state (1 x 1) when it is not yet.
    """
    from megatron.core import parallel_state

    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.parallel import initialize_parallel

    missing = [k for k in MODEL_CONFIG_REQUIRED if k not in model_config]
    if missing:
        raise ValueError(f"model_config lacks {missing}; required: {list(MODEL_CONFIG_REQUIRED)}")
    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(1, 1)
    cfg = dict(model_config)
    vocab_size = int(cfg.pop("vocab_size"))
    max_seq_length = int(cfg.pop("max_seq_length", 4096))
    rotary_base = float(cfg.pop("rotary_base", 10000.0))
    share = bool(cfg.pop("share_embeddings", False))
    rope_scaling_factor = cfg.pop("rope_scaling_factor", None)
    dtype = cfg.pop("params_dtype", "float32")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"model_config params_dtype must be one of {list(_DTYPES)}")
        dtype = _DTYPES[dtype]
    config = llama_transformer_config(params_dtype=dtype, **cfg)
    runtime = None
    if dmc_config is not None:
        if isinstance(dmc_config, dict):
            dmc_config = DMCConfig(**dmc_config)
        runtime = DMCRuntime(dmc_config)
        runtime.set_mode("eval")
    return build_gpt_model(config, vocab_size, max_seq_length, dmc=runtime,
                           rotary_base=rotary_base, share_embeddings=share,
                           rope_scaling_factor=rope_scaling_factor)


def save_inference_state(path, model: torch.nn.Module, model_config: dict,
                         dmc_config: DMCConfig | dict | None = None) -> None:
    """Write the single-file format that :meth:`Engine.from_file` and ``dmc generate
    --state-dict`` read (``torch.save`` of a plain dict, loadable with ``weights_only=True``)::

        {"format": 1,
         "model_config": {...},          # see build_model_from_config
         "dmc_config": {...} or None,    # DMCConfig fields; None = vanilla model
         "state_dict": {name: tensor}}   # model.state_dict(), tensors only
    """
    if isinstance(dmc_config, DMCConfig):
        dmc_config = asdict(dmc_config)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    torch.save({"format": STATE_FORMAT, "model_config": dict(model_config),
                "dmc_config": None if dmc_config is None else dict(dmc_config),
                "state_dict": state}, path)


def load_inference_state(path) -> dict:
    """Read and check a file written by :func:`save_inference_state`."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not {"model_config", "state_dict"} <= saved.keys():
        raise ValueError(
            f"{path}: not a dmc inference state (a dict with 'model_config', 'dmc_config' and "
            f"'state_dict'; see dmc.inference.engine.save_inference_state)"
        )
    saved.setdefault("dmc_config", None)
    return saved
