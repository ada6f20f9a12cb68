"""``Engine``: a megatron-core GPT model (vanilla, GQA or DMC) served with a paged per-head cache.

Each :meth:`Engine.step` asks the :class:`~dmc.inference.scheduler.Scheduler` for a plan (decode
tokens plus prefill chunks of several sequences under one token budget, pages reserved and any
preemption done before the model runs), runs it as one forward of the
:class:`~dmc.inference.model_runner.ModelRunner` and samples (with ``overlap=True`` a decode
step is launched before the previous one is read back: :mod:`dmc.inference.overlap`). The KV
writes (:mod:`dmc.inference.kv_write`) give DMC's eval-mode Algorithm 1, DMS's delayed eviction
(``dmc.method="dms"``) or DMC with delayed merging (``dmc.merge_delay``); prefill is exact and
chunked. A preempted sequence restarts by prefilling its prompt and the tokens it generated, under
a KV policy by prefilling its prompt and feeding the tokens it generated back one per decode step
(the decode steps and evictions it had); its sampler state is kept: the same output, to the bit in
float32 (under a policy: log-probabilities within 1e-5, tested); under a bf16 / fp16 cache within
its rounding, as the prefill attends over a chunk's keys before the cache rounds them. One that
cannot fit in the whole pool alone ends with ``finish_reason="cache_full"``.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch

from dmc.inference.paging import check_engine_sizes, pages_for, to_device
from dmc.inference.decode_graphs import DecodeGraphs
from dmc.inference.device_span import DeviceSpan
from dmc.inference.generation import TokenDelta, generate, stream
from dmc.inference.kv_write import make_cache, make_kv_write, make_policy
from dmc.inference.loading import load_inference_state, load_model, load_plain
from dmc.inference.model_runner import ModelRunner, resolve_dmc, rope_frequencies
from dmc.inference.overlap import DecodePipeline
from dmc.inference.sampling import SamplingParams, sample_on_device
from dmc.inference.scheduler import Scheduler, StepPlan
from dmc.inference.scoring import score_batch
from dmc.inference.sequence import (
    CompressionStats,
    EngineStats,
    GenerationResult,
    ScoreResult,
    Sequence,
)
from dmc.megatron.compat import cuda_rewrite_suspended
from dmc.megatron.config import DMCConfig, ModelConfig
from dmc.megatron.runtime import DMCRuntime


class Engine:
    """Chunked-prefill, batched-decode generation with a paged (DMC-compressed) KV cache.

    Args:
        model: a megatron-core ``GPTModel`` from :func:`dmc.megatron.model.build_gpt_model`
            (TP = PP = 1, RoPE). The engine puts it in ``eval()`` mode and runs it under
            ``torch.inference_mode``.
        dmc: ``"auto"`` (DMC semantics when the model has ``DMCSelfAttention`` layers, with their
            runtime's config), a :class:`DMCRuntime` or :class:`DMCConfig` (DMC semantics with
            these ``c`` and ``window``, or DMS ones with ``method="dms"``, ``c``,
            ``dms_logit_scale``, ``dms_window``, whatever the attention modules are), or
            ``None`` (vanilla attention).
        num_pages: pages in the pool; default: room for ``max_batch`` uncompressed sequences of
            ``max_seq_len`` tokens, capped by ``kv_cache_bytes``.
        kv_cache_bytes: byte budget of everything the cache allocates when ``num_pages`` is
            not given (:func:`~dmc.inference.allocation.cache_allocation`: the page pool of
            keys and values, and for ``max_batch`` sequence slots their block tables and
            lengths, DMC's merge state, DMS's and delayed merging's rings of raw tokens);
            default: 90% of the free GPU memory on CUDA, a quarter of the RAM on CPU.
        page_size: slots per page.
        max_batch: most sequences running at once (= cache sequence slots).
        max_seq_len: most tokens (prompt + generated) per sequence; default: the model's
            ``max_sequence_length``.
        chunk_size: most prefill tokens of one sequence per step.
        step_tokens: token budget of a forward (decode tokens plus prefill chunks of several
            sequences), at least and by default ``max_batch + chunk_size``.
        batch_prefill: False runs every prefill chunk and the decode tokens of a step as separate
            forwards (one sequence at a time; same outputs, for comparison).
        cache_dtype: dtype of the page pools; default: the model's parameter dtype.
        use_triton: kernel choice (None: Triton on CUDA, PyTorch on CPU).
        seed: base seed of requests that set none (request ``i`` uses ``seed + i``).
        policy: a training-free KV policy from :func:`dmc.policies.get_policy` (vanilla or GQA
            models only): it evicts after a forward when its schedule says so (after the prompt's
            last chunk, or after every chunk and decode step), freeing pages; the compression
            stats report the slots held, so under the ``"prefill"`` schedule the measured CR
            falls as the decode phase grows.
        cuda_graphs: run the steps that only decode through static buffers, replayed from a CUDA
            graph per batch size on a GPU, eagerly on the CPU
            (:class:`~dmc.inference.decode_graphs.DecodeGraphs`); any model without a KV
            policy (under DMS, once every sequence of the step fills its window ring).
        overlap: launch each such step before the previous one is read back, so that a step's
            host work runs while the device works (:mod:`dmc.inference.overlap`); needs
            ``cuda_graphs=True``.

    ``stats``: an :class:`EngineStats`.
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
        step_tokens: int | None = None,
        batch_prefill: bool = True,
        cache_dtype: torch.dtype | None = None,
        use_triton: bool | None = None,
        seed: int = 0,
        policy=None,
        cuda_graphs: bool = False,
        overlap: bool = False,
    ):
        from megatron.core import parallel_state

        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise ValueError("Engine supports tensor_parallel = pipeline_parallel = 1 only")
        if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
            raise ValueError("Engine needs a whole model (pre_process and post_process)")
        check_engine_sizes(chunk_size, max_batch, page_size, max_seq_len, step_tokens,
                           cache_dtype)
        if model.config.apply_residual_connection_post_layernorm:
            raise ValueError("Engine supports pre-norm residuals only")
        self.model = model.eval()
        self.config = model.config
        layers = list(model.decoder.layers)
        self.dmc = resolve_dmc(layers, dmc)
        attn = layers[0].self_attention
        self.num_layers = len(layers)
        self.num_heads = attn.num_attention_heads_per_partition
        self.num_kv_heads = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = self.config.softmax_scale or self.head_dim ** -0.5
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_seq_len = int(max_seq_len or model.max_sequence_length)
        self.page_size, self.max_batch, self.chunk_size = page_size, max_batch, chunk_size
        self.cache = make_cache(self.dmc, self.num_layers, self.num_kv_heads, self.head_dim,
                                num_pages=num_pages, kv_cache_bytes=kv_cache_bytes,
                                page_size=page_size, max_batch=max_batch,
                                max_seq_len=self.max_seq_len, dtype=cache_dtype or self.dtype,
                                device=self.device, model_dtype=self.dtype,
                                inv_freq=rope_frequencies(model, self.head_dim))
        self.policy = make_policy(policy, self.dmc, self.cache, self.num_heads, self.scale)
        self.kv = make_kv_write(self.dmc, self.cache, self.num_heads, self.scale,
                                self.cache.inv_freq, self.policy, use_triton)
        self.runner = ModelRunner(self.model, self.kv)
        if cuda_graphs and policy is not None:
            raise ValueError(f"Engine: cuda_graphs=True needs a model without a KV policy "
                             f"(got policy={policy!r}); accepted: cuda_graphs=False, or "
                             f"policy=None")
        self.graphs = DecodeGraphs(self.runner) if cuda_graphs else None
        self.pipeline = DecodePipeline(self) if overlap else None
        self.scheduler = Scheduler(self.cache, max_batch, chunk_size,
                                   step_tokens or max_batch + chunk_size,
                                   whole_chunks=self.policy.evicts_after_chunks,
                                   replay=self.policy.replays_decode)
        self.batch_prefill = batch_prefill
        self.seed = seed
        self._next_id = 0
        self._unclaimed: list[GenerationResult] = []
        self.reset_stats()

    @classmethod
    def from_state_dict(cls, state_dict: dict, model_config: ModelConfig | dict,
                        dmc_config: DMCConfig | dict | None = None, **engine_kwargs) -> Engine:
        """Build the model from ``model_config`` (see
        :func:`dmc.megatron.model.build_model_from_config`), load ``state_dict`` into it and
        wrap it; ``dmc_config`` None = a vanilla model."""
        from dmc.megatron.model import build_model_from_config

        model = build_model_from_config(model_config, dmc_config)
        load_plain(model, state_dict, "state_dict")
        return cls(model, **engine_kwargs)

    @classmethod
    def from_path(cls, path, **engine_kwargs) -> Engine:
        """An engine for the model at ``path``: an inference ``.pt`` file, a training checkpoint
        folder (any TP/PP), a checkpoints folder or a run folder (its latest checkpoint); see
        :func:`dmc.inference.loading.load_model`."""
        return cls(load_model(path).model, **engine_kwargs)

    @classmethod
    def from_file(cls, path, **engine_kwargs) -> Engine:
        """An engine from a file written by :func:`save_inference_state`."""
        saved = load_inference_state(path)
        return cls.from_state_dict(saved["state_dict"], saved["model_config"],
                                   saved["dmc_config"], **engine_kwargs)

    def add_request(self, prompt: Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids); returns its request id (arrival order)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        Sequence.check_prompt(prompt, params, self.max_seq_len, self.model.vocab_size)
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else self.seed + request_id
        self.scheduler.add(Sequence(request_id, prompt, params, seed,
                                    arrived=time.perf_counter()))
        return request_id

    def abort(self, request_id: int) -> bool:
        """Stop request ``request_id`` (waiting or running): its pages return now and the next
        :meth:`step` returns its result (``finish_reason="abort"``, the tokens generated so
        far). False when the engine does not hold it (unknown, or finished already)."""
        if self.pipeline is not None:  # its step in flight read back, the cache settled
            self.pipeline.drain(self._unclaimed)
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._unclaimed.append(self._result(seq, "abort", seq.cached))
        if seq.slot is not None:
            self.cache.free_sequence(seq.slot)
        return True

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or a result waits for :meth:`step`."""
        return self.scheduler.has_unfinished() or bool(self._unclaimed)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[GenerationResult]:
        """Run scheduled forwards (each: decode tokens plus prefill chunks under the token
        budget) until one of them decodes, sampling after each: a step gives every decoding
        sequence one token (under ``overlap``, read back by the next call), and prefills new ones
        meanwhile. Returns the requests that finished during this step (and those of requests
        queued with :meth:`add_request` that finished inside :meth:`generate`)."""
        finished, self._unclaimed = self._unclaimed, []
        with torch.inference_mode(), cuda_rewrite_suspended():
            if self.pipeline is None or not self.pipeline.advance(finished):
                self._schedule_and_run(finished)
            self.stats.preemptions = self.scheduler.preemptions
        return finished

    def _schedule_and_run(self, finished: list[GenerationResult]) -> None:
        while True:
            plan = self.scheduler.schedule()
            finished += [self._result(seq, "cache_full", 0, error=error)
                         for seq, error in plan.failed]
            for part in [plan] if self.batch_prefill else plan.one_at_a_time():
                self._run(part, finished)
            if plan.decode or not plan.prefill:
                break

    def _run(self, plan: StepPlan, finished: list[GenerationResult]) -> None:
        """One forward of ``plan``; samples for the decode tokens and the finished prefills.
        The sampled tokens come back to the host with the lengths of the deferred cache writes
        in one copy: on a GPU the only wait for the device in a decode step."""
        if not (plan.decode or plan.prefill):
            return
        started, span = time.perf_counter(), DeviceSpan(self.device)
        drawn = None  # the tokens a graph drew
        if (self.graphs is not None and not plan.prefill
                and self.kv.static_ready([s.slot for s in plan.decode])):  # forward, sampling
            if self.pipeline is not None:  # left in flight: read back by the next step
                self.pipeline.launch(plan.decode, started)
                return
            drawn = self.graphs.decode(plan.decode, span)
        else:
            span.begin()
            logits = self.runner.forward(plan.segments())  # a row per segment
        self.stats.prefill_tokens += sum(n for _, n in plan.prefill)
        drawing = self.scheduler.advance(plan)  # (sequence, logits row) of those drawing a token
        sampled = [seq for seq, _ in drawing]
        if drawn is None and drawing:
            picked = [row for _, row in drawing]
            drawn = sample_on_device(logits[:len(picked)] if picked[-1] == len(picked) - 1
                                     else logits[to_device(torch.tensor(picked), self.device)],
                                     [s.params for s in sampled],
                                     [s.seed for s in sampled],
                                     [len(s.generated) for s in sampled])
        span.end()
        drawn = self.cache.settle(carry=drawn)
        if drawn is None:
            self._sync()  # nothing read back: wait for the device before timing
        elapsed = time.perf_counter() - started
        if plan.prefill:
            self.stats.prefill_seconds += elapsed
        else:
            self.stats.add_decode(elapsed, span.seconds(), len(plan.decode))
        self._note_usage()
        if sampled:
            self._take_tokens(sampled, drawn, finished)

    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 progress: bool = False) -> list[GenerationResult]:
        """Generate for every prompt (continuous batching); results in prompt order: see
        :func:`dmc.inference.generation.generate`."""
        return generate(self, prompts, params, progress=progress)

    def stream(self, prompts: Seq[Seq[int]],
               params: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[TokenDelta]:
        """:meth:`generate`, each request's tokens handed out as the steps sample them: see
        :func:`dmc.inference.generation.stream`."""
        return stream(self, prompts, params)

    def score(self, tokens: Seq[int], *, return_logits: bool = False,
              prefill_tokens: int | None = None) -> ScoreResult:
        """Teacher forcing through the real compressed cache: the log-probability of every next
        token. The first ``prefill_tokens`` tokens (None: all) go through chunked prefill, the
        others one at a time through the decode path, so that a policy compresses as in
        generation (DMC and vanilla give the same result either way). Uses one sequence slot
        and its pages for the duration of the call (no preemption: :class:`CacheFullError` when
        they do not fit). :meth:`score_batch` scores several sequences at once."""
        return self.score_batch([tokens], return_logits=return_logits,
                                prefill_tokens=prefill_tokens)[0]

    def score_batch(self, sequences: Seq[Seq[int]], *, return_logits: bool = False,
                    prefill_tokens: int | Seq[int | None] | None = None) -> list[ScoreResult]:
        """:meth:`score` for several sequences: each is prefilled on its own, then their
        teacher-forced tokens are decoded as one batch (a sequence leaves the batch when its
        tokens run out). ``prefill_tokens`` is one value for all or one per sequence. At most
        ``max_batch`` sequences (the cache's sequence slots); see
        :func:`dmc.inference.scoring.score_batch`."""
        if self.pipeline is not None:  # its step in flight read back: the cache settled
            self.pipeline.drain(self._unclaimed)
        with cuda_rewrite_suspended():
            return score_batch(self, sequences, return_logits, prefill_tokens)

    def sequence_bytes(self, slot: int) -> dict:
        """Bytes the cache holds for the sequence in ``slot``: its pages (``kv``), their block
        table entries and per-head lengths (``metadata``), the DMC merge state of every head
        (``dmc_state``: the window ring or running mean in float32, its weights and count; under
        DMS the window ring of ``w + 1`` keys, values and flags) and a policy's per-slot and
        per-sequence state (``policy_state``); ``total`` sums them."""
        out = self.cache.sequence_bytes(slot, dmc_state=self.kv.keeps_merge_state)
        out["policy_state"] = self.policy.state_bytes(slot)
        out["total"] = sum(out.values())
        return out

    def reset_stats(self) -> None:
        """Zero the counters in ``self.stats``."""
        self.stats = EngineStats()
        self.scheduler.preemptions = 0

    def _take_tokens(self, seqs: list[Sequence], drawn: torch.Tensor,
                     finished: list[GenerationResult],
                     lengths: torch.Tensor | None = None) -> list[Sequence]:
        """Append each sequence's sampled token (``drawn [2, batch]`` host float64: tokens,
        log-probabilities); end and return the sequences that reach a stop token or
        ``max_new_tokens``, freeing their pages; or, with ``lengths`` (host ``[batch, layers,
        kv]``, what their overlapped step left), their compression read there, slots kept."""
        chosen, logps = [int(t) for t in drawn[0].tolist()], drawn[1].tolist()
        ended = []
        for row, (seq, token, logp) in enumerate(zip(seqs, chosen, logps)):
            seq.generated.append(token)
            seq.logprobs.append(logp)
            seq.decoding, seq.first_token = True, seq.first_token or time.perf_counter()
            self.stats.generated_tokens += 1
            stop = token in seq.params.stop_tokens
            if stop or len(seq.generated) >= seq.params.max_new_tokens:
                finished.append(self._result(seq, "stop" if stop else "length",
                                             seq.num_tokens - 1,
                                             None if lengths is None else lengths[row]))
                self.scheduler.running.remove(seq)
                ended.append(seq)
                if lengths is None:
                    self.cache.free_sequence(seq.slot)
        return ended

    def _result(self, seq: Sequence, reason: str, tokens: int, paged: torch.Tensor | None = None,
                error: str | None = None) -> GenerationResult:
        """``seq``'s result, its cache holding ``tokens`` tokens (``paged``: its lengths as an
        overlapped step left them, else the cache's; nothing without a slot)."""
        if seq.slot is None:
            zero = torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.long)
            return seq.result(reason, CompressionStats(0, zero), 0, 0, error)
        if paged is None:
            compression = self.compression(seq.slot, tokens)
            paged = self.cache.head_lengths(seq.slot)
        else:
            compression = CompressionStats(tokens, self.cache.held_slots(seq.slot, paged))
        return seq.result(reason, compression, int(pages_for(paged, self.page_size).sum()),
                          self.cache.page_bytes, error)

    def compression(self, slot: int, tokens: int) -> CompressionStats:
        """The compression of the sequence in ``slot`` after ``tokens`` tokens (with a policy:
        the slots it reports)."""
        return CompressionStats(tokens, self.policy.reported_slots(slot, tokens))

    def _note_usage(self) -> None:
        self.stats.peak_running = max(self.stats.peak_running, self.num_running)
        self.stats.peak_pages = max(self.stats.peak_pages, self.cache.pages_in_use)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
