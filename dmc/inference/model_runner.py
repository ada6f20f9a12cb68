"""The model side of :class:`~dmc.inference.engine.Engine`: embedding -> layers (norm, QKV,
attention over the paged cache, output projection, MLP) -> final norm and logits.

One forward takes any mix of *segments*: prefill chunks of several sequences and one decode token
of others. Everything but attention runs once over all their tokens, ``[tokens, 1, hidden]``
(megatron's ``[seq, batch, hidden]``); attention runs per prefill chunk and once for all decode
tokens, through the cache's :class:`~dmc.inference.kv_write.KVWrite` strategy. The model's own
modules are reused (TP = PP = 1). A forward reads nothing back from the device: the lengths the
deferred DMC / DMS writes reached stay there until the caller settles the cache
(:meth:`~dmc.inference.cache.PagedKVCache.settle`; every cache method that needs them settles
first).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dmc.inference.paging import to_device
from dmc.inference.kv_write import KVWrite
from dmc.inference.kv_write_dms import append_adapter_logits
from dmc.megatron.config import DMCConfig
from dmc.megatron.runtime import DMCRuntime


@dataclass
class Segment:
    """Tokens of one sequence fed in a forward.

    slot: the sequence's cache slot; tokens: ids at positions ``start, start + 1, ...``;
    decode: one token written by the decode path (append or merge), else a prefill chunk;
    all_logits: the logits of every token are returned, else those of the last one;
    prompt_end: a prefill chunk that ends what is prefilled before decoding (a policy under the
    ``"prefill"`` schedule compresses after it).
    """

    slot: int
    tokens: list[int]
    start: int
    decode: bool = False
    all_logits: bool = False
    prompt_end: bool = False


class ModelRunner:
    """Runs ``model`` (a megatron-core ``GPTModel`` in eval mode) over segments, writing the
    cache through ``kv`` and letting ``kv.policy`` evict after each forward (when its schedule
    says so)."""

    def __init__(self, model: torch.nn.Module, kv: KVWrite):
        self.model, self.kv = model, kv
        self.layers = list(model.decoder.layers)
        self.device = next(model.parameters()).device

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """One forward over ``segments`` (distinct sequences; the decode tokens first). Returns
        the logits of the rows wanted, segment after segment: every token's of an
        ``all_logits`` segment, the last token's of the others; ``[rows, vocab]``."""
        rows = sum(s.decode for s in segments)
        if not all(s.decode for s in segments[:rows]):
            raise ValueError("ModelRunner.forward: decode segments must come first")
        decode, prefill = segments[:rows], segments[rows:]
        ids = to_device(torch.tensor([t for s in segments for t in s.tokens]), self.device)
        positions = to_device(torch.tensor([s.start + i for s in segments
                                            for i in range(len(s.tokens))]), self.device)
        for seg in prefill:
            if seg.start == 0:
                self.kv.policy.reset(seg.slot)
        x = self.model.embedding(input_ids=ids[None], position_ids=positions[None])
        decode_slots, decode_positions = [s.slot for s in decode], positions[:rows]
        if decode:
            self.kv.begin_decode(decode_slots, decode_positions)
            self.kv.prepare_rotations()
        for index, layer in enumerate(self.layers):
            query, key, value = self._qkv(layer.self_attention, layer.input_layernorm(x))
            query, key, value = query[:, 0], key[:, 0], value[:, 0]  # [tokens, heads, dim]
            parts = []
            if decode:
                parts.append(self.kv.decode(index, query[:rows], key[:rows], value[:rows]))
            start = rows
            for seg in prefill:
                end = start + len(seg.tokens)
                parts.append(self.kv.prefill(index, seg.slot, query[start:end], key[start:end],
                                             value[start:end], seg.start))
                start = end
            x = self._finish_layer(layer, x, torch.cat(parts).reshape(x.shape[0], 1, -1))
        if decode:
            self.kv.policy.evict(decode_slots, torch.tensor([s.start + 1 for s in decode]),
                                 decode=True)
        for seg in prefill:
            self.kv.policy.evict([seg.slot], [seg.start + len(seg.tokens)], decode=False,
                                 prompt_end=seg.prompt_end)
        return self._segment_logits(x, segments)

    def decode_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device work of a forward of decode tokens only, after the host work of
        :meth:`KVWrite.begin_decode` (which took the step's sequences, in the same order):
        ``ids, positions [batch]`` (device) -> logits ``[batch, vocab]``. Reads nothing from
        the host and, with the step's ``max_length`` fixed, launches the same kernels for any
        step of a batch size: what :class:`~dmc.inference.decode_graphs.DecodeGraphs` captures.
        No KV policy (its hooks run on the host)."""
        self.kv.prepare_rotations()
        x = self.model.embedding(input_ids=ids[None], position_ids=positions[None])
        for index, layer in enumerate(self.layers):
            query, key, value = self._qkv(layer.self_attention, layer.input_layernorm(x))
            context = self.kv.decode(index, query[:, 0], key[:, 0], value[:, 0])
            x = self._finish_layer(layer, x, context.reshape(x.shape[0], 1, -1))
        return self._logits(x)

    @staticmethod
    def _qkv(attention, hidden):
        """The attention's ``query, key, value [tokens, 1, heads, dim]`` of ``hidden``; a DMS
        adapter's logits ride along as an extra query channel
        (:func:`~dmc.inference.kv_write_dms.append_adapter_logits`)."""
        query, key, value = attention.get_query_key_value_tensors(hidden)
        if getattr(attention, "decision_proj", None) is not None:
            query = append_adapter_logits(query, attention.decision_logits(hidden))
        return query, key, value

    def _segment_logits(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Final norm and output layer on the rows whose logits are wanted (all of them when
        every segment is one token, as in a decode step)."""
        if all(len(seg.tokens) == 1 for seg in segments):
            return self._logits(x)
        picked, row = [], 0
        for seg in segments:
            n = len(seg.tokens)
            picked.extend(range(row, row + n) if seg.all_logits else [row + n - 1])
            row += n
        return self._logits(x[to_device(torch.tensor(picked), x.device)])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: ``x [rows, 1, hidden]`` -> ``[rows, vocab]``."""
        hidden = self.model.decoder.final_layernorm(x)
        weight = None
        if self.model.share_embeddings_and_output_weights:
            weight = self.model.shared_embedding_or_output_weight()
        logits, _ = self.model.output_layer(hidden, weight=weight)
        return logits[:, 0]

    @staticmethod
    def _finish_layer(layer, x, context):
        """Output projection, residual, MLP block. ``context [tokens, 1, heads * dim]``."""
        out, bias = layer.self_attention.linear_proj(context.to(x.dtype))
        x = x + out if bias is None else x + out + bias
        out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
        return x + out if bias is None else x + out + bias


def resolve_dmc(layers, dmc) -> DMCConfig | None:
    """The DMC semantics an engine serves: ``"auto"`` (the config of the model's DMC layers,
    None without), a :class:`DMCRuntime` or :class:`DMCConfig`, or None (vanilla)."""
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


def rope_frequencies(model, head_dim: int) -> torch.Tensor:
    """The model's RoPE frequencies ``[head_dim // 2]`` (float32, on its device), checked to be
    plain full-dimension rotate-half RoPE."""
    rope = getattr(model, "rotary_pos_emb", None)
    if getattr(model, "position_embedding_type", None) != "rope" or rope is None:
        raise ValueError("Engine supports RoPE models only (position_embedding_type='rope')")
    if rope.rotary_interleaved or rope.seq_len_interpolation_factor is not None:
        raise ValueError("Engine supports rotate-half RoPE without position interpolation only")
    inv_freq = rope.inv_freq.float()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"Engine needs RoPE over the whole head (rotary_percent=1): "
                         f"{inv_freq.numel()} frequencies for head_dim {head_dim}")
    return inv_freq.to(next(model.parameters()).device)
