"""``DMCSelfAttention``: megatron-core self-attention with Dynamic Memory Compression (its DMS
sibling, :class:`dmc.megatron.dms_attention.DMSSelfAttention`, overrides the attention itself).

Modes (set on the shared :class:`~dmc.megatron.runtime.DMCRuntime`):
- ``vanilla``: megatron's attention, untouched;
- ``zero_out``: megatron's core attention with q[..., -1] and k[..., -1] multiplied by
  ``zero_out_scale`` (= 1 - t / n_t, Eq. 12) before and after RoPE (before the q/k norm when
  the layer has one, :meth:`DMCSelfAttention._scale_before_norm`);
  :func:`zero_decision_rows_` then zeroes those rows of ``linear_qkv``;
- ``train``: alpha = GumbelSigmoid(k[..., -1] - c, tau) (Eq. 8), omega = sigmoid(q[..., -1] + c),
  decision channels zeroed before and after RoPE, window-grouped partial accumulation of pre-RoPE
  keys and values (Eq. 9), RoPE, attention with the additive log(1 - alpha) mask (App. H) and the
  CR loss (Eq. 10, per sequence; global or App. G's local prior; :mod:`dmc.megatron.cr_loss`)
  attached through megatron's aux-loss path;
- ``eval``: hard decisions alpha = [k[..., -1] - c > 0] and a -inf/0 mask: exactly what
  inference with a compressed cache computes (Algorithm 1).

With ``dmc.merge_delay`` = d >= 1 (delayed merging, not in the paper) ``train`` and ``eval``
attend over the accumulated keys and the raw keys of the last d + 1 tokens
(:func:`dmc.ops.delayed_merge_attention`).

Megatron tensors are ``[seq, batch, heads, dim]``; the ops take ``[batch, heads, seq, dim]``.
"""
from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from dmc.megatron.accumulate_backend import window_kernels
from dmc.megatron.cr_loss import attach_cr_loss, attach_head_balance_loss
from dmc.megatron.runtime import DMCRuntime
from dmc.ops import (
    decision_logits,
    delayed_merge_attention,
    dmc_attention,
    logistic_noise,
    partial_accumulate,
    relaxed_decisions,
    scale_decision_channel,
    straight_through_round,
    zero_decision_channel,
)
from dmc.ops.mask import log_keep_next
from dmc.ops.rope import rotate


def to_bhsd(x: torch.Tensor) -> torch.Tensor:
    """Megatron's ``[seq, batch, heads, dim]`` as the ops' ``[batch, heads, seq, dim]`` (a view)."""
    return x.permute(1, 2, 0, 3)


def to_sbhd(x: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, seq, dim]`` as megatron's ``[seq, batch, heads, dim]`` (a view)."""
    return x.permute(2, 0, 1, 3)


class DMCSelfAttention(SelfAttention):
    """Self-attention whose KV heads learn to append or merge (a ``SelfAttention`` subclass,
    built through :func:`dmc.megatron.layer_spec.dmc_layer_spec`). ``method`` names the
    compression method the class implements (``dmc.method``)."""

    method = "dmc"

    def __init__(self, config, submodules, layer_number, dmc: DMCRuntime,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type=None, pg_collection=None):
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if config.num_query_groups < self.world_size:
            raise ValueError(
                f"DMC needs whole query groups on each tensor-parallel rank: num_query_groups="
                f"{config.num_query_groups} < tensor_model_parallel_size={self.world_size}"
            )
        if config.attention_dropout:
            raise ValueError(
                f"DMC attention supports attention_dropout=0 only, got {config.attention_dropout}"
            )
        self.dmc = dmc
        dmc.layers.append(self)
        dmc.layers.sort(key=lambda layer: layer.layer_number)
        self.softmax_scale = config.softmax_scale or self.hidden_size_per_attention_head ** -0.5
        heads = self.num_query_groups_per_partition
        self.register_buffer("cr_kept", torch.zeros(heads, dtype=torch.float64), persistent=False)
        self.register_buffer("cr_count", torch.zeros((), dtype=torch.float64), persistent=False)
        self._pre_norm_scale = None  # set by _zero_out_qkv around the q/k projection
        if config.qk_layernorm:
            for norm in (self.q_layernorm, self.k_layernorm):
                norm.register_forward_pre_hook(self._scale_before_norm)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """``hidden_states [seq, batch, hidden] -> (output [seq, batch, hidden], bias)``."""
        if self.dmc.mode == "vanilla":
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                inference_params=inference_params,
            )
        if inference_context is not None or inference_params is not None:
            raise ValueError(
                "DMCSelfAttention does not use megatron's inference context in zero_out/train/eval "
                "mode; serve DMC models with dmc.inference.Engine"
            )
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("DMC attention supports neither packed sequences nor attention_bias")
        if attention_mask is not None and self.dmc.mode != "zero_out":
            raise ValueError(f"DMC attention builds its own causal mask in {self.dmc.mode} "
                             f"mode: attention_mask must be None (no padding or document masks)")
        if self.dmc.config.method != self.method:
            raise ValueError(
                f"dmc.method is {self.dmc.config.method!r} but this layer was built for "
                f"{self.method!r}: build the model from the config it runs with"
            )
        if self.dmc.mode == "zero_out":
            return self._zero_out_forward(hidden_states, attention_mask, rotary_pos_emb)

        context, alpha = self._compressed_attention(hidden_states, rotary_pos_emb)
        seq, batch = hidden_states.shape[:2]
        output, bias = self.linear_proj(to_sbhd(context).reshape(seq, batch, -1))
        kept = self._record_kept(alpha)
        if self.dmc.mode == "train" and torch.is_grad_enabled():
            if self.dmc.config.cr_loss_grad == "decisions":
                alpha = self._decisions(self._decision_rows_logit(hidden_states))[0]
                kept = self._kept(alpha)
            output = attach_cr_loss(self, output, kept, alpha.shape[2])
            if self.dmc.config.head_balance_weight:
                output = attach_head_balance_loss(self, output, self._loss_alpha(alpha))
        return output, bias

    def _decision_rows_logit(self, hidden_states):
        """``alpha_logit [batch, kv_heads, seq]`` recomputed from the decision rows of
        ``linear_qkv`` and the detached layer input (``dmc.cr_loss_grad: decisions``): the same
        values as the attention's (its noise too, from the same generator key), but a loss on it
        reaches only those rows."""
        if self.config.qk_layernorm or self.config.sequence_parallel or not isinstance(
                getattr(self.linear_qkv, "weight", None), torch.Tensor) or hasattr(
                self.linear_qkv, "layer_norm_weight"):
            raise ValueError("dmc.cr_loss_grad: 'decisions' needs linear_qkv to be a plain linear "
                             "map of the layer input (the local layer spec, no q/k norm, no "
                             "sequence parallelism); use 'model'")
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        rows = decision_rows(self)[per_group::per_group + 1]  # k[..., -1] of each KV head
        bias = getattr(self.linear_qkv, "bias", None)
        has_bias = isinstance(bias, torch.Tensor) and bias.numel() > 0
        logit = torch.nn.functional.linear(hidden_states.detach(), self.linear_qkv.weight[rows],
                                           bias[rows] if has_bias else None)
        return logit.permute(1, 2, 0) - self.dmc.config.c

    def _compressed_attention(self, hidden_states, rotary_pos_emb):
        """DMC attention of ``train`` and ``eval`` mode: ``hidden_states [seq, batch, hidden] ->
        (context [batch, q_heads, seq, dim], alpha [batch, kv_heads, seq])`` (this rank's heads).

        Decision channels read (Sec. 3.1), window-grouped partial accumulation of pre-RoPE keys
        and values (Eq. 9), RoPE without the decision channels, then the additive
        log(1 - alpha) mask. The keys are accumulated with their decision channel, zeroed
        afterwards (each channel's sum is its own, so the others are those of zeroed keys):
        what Eq. 9's backward keeps is then a view of the projection's output, which the
        values' sums keep anyway, not a zeroed copy of the keys."""
        cfg = self.dmc.config
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        alpha_logit, omega = self._fused(decision_logits)(to_bhsd(query), to_bhsd(key), cfg.c,
                                                          cfg.omega_offset)
        alpha, log_keep = self._decisions(alpha_logit)
        key_acc, value_acc = partial_accumulate(
            to_bhsd(key), to_bhsd(value), alpha, omega, cfg.window,
            windowed=window_kernels(cfg.accumulate_backend, key))
        if cfg.merge_delay:
            return self._delayed_merge_attention(query, key, key_acc, value_acc, to_bhsd(value),
                                                 log_keep, rotary_pos_emb), alpha
        query, key_acc = self._rotate_without_decisions(query, to_sbhd(key_acc), rotary_pos_emb)
        context = dmc_attention(to_bhsd(query), to_bhsd(key_acc), value_acc, log_keep,
                                scale=self.softmax_scale, backend=cfg.attention_backend,
                                zero_key_channel=True)
        return context, alpha

    def _delayed_merge_attention(self, query, key, key_acc, value_acc, value, log_keep,
                                 rotary_pos_emb):
        """``dmc.merge_delay`` d >= 1: the accumulated and the raw keys (``key [seq, batch,
        kv_heads, dim]``), both rotated at their own positions without their decision channels
        (:meth:`_rotate_without_decisions`), under :func:`dmc.ops.delayed_merge_attention`."""
        batch = key_acc.shape[0]
        keys = torch.cat([to_sbhd(key_acc), key], dim=1)  # [seq, 2 batch, kv_heads, dim]
        query, keys = self._rotate_without_decisions(query, keys, rotary_pos_emb)
        keys = to_bhsd(keys)
        return delayed_merge_attention(
            to_bhsd(query), keys[:batch], value_acc, keys[batch:], value,
            log_keep, self.dmc.config.merge_delay, scale=self.softmax_scale,
            backend=self.dmc.config.attention_backend, zero_key_channel=True)

    def _zero_out_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        """Megatron's core attention with q[..., -1] and k[..., -1] multiplied by
        ``zero_out_scale`` (Eq. 12) before AND after RoPE.

        The paper scales the channel once; scaling after RoPE as well is NVIDIA's
        ``forward_decay_decision_neuron``: rotate-half moves x[d/2 - 1] into the last channel, so
        only then does scale 0 take the decision channel out of q.k entirely, as ``eval`` mode
        does (the model at the end of the zero-out phase is then the DMC model with no merges).
        """
        scale = self.dmc.zero_out_scale
        query, key, value = self._zero_out_qkv(hidden_states, scale)
        query, key = self._rotate(query, key, rotary_pos_emb)
        query, key = scale_decision_channel(query, scale), scale_decision_channel(key, scale)
        context = self.core_attention(query, key, value, attention_mask,
                                      attn_mask_type=self.attn_mask_type)
        return self.linear_proj(context)

    def _zero_out_qkv(self, hidden_states, scale):
        """``get_query_key_value_tensors`` with the borrowed channels (:meth:`_scale_borrowed`)
        multiplied by ``scale``: after the projection, or before the q/k norm when the layer
        has one (:meth:`_scale_before_norm`). Only the zero-out forward scales: the inference
        engine calls ``get_query_key_value_tensors`` itself and gets eval semantics whatever
        the runtime's mode."""
        if not self.config.qk_layernorm:
            query, key, value = self.get_query_key_value_tensors(hidden_states)
            return (self._scale_borrowed(query, True, scale),
                    self._scale_borrowed(key, False, scale), value)
        self._pre_norm_scale = scale
        try:
            return self.get_query_key_value_tensors(hidden_states)
        finally:
            self._pre_norm_scale = None

    def _scale_before_norm(self, norm, args):
        """Forward pre-hook of ``q_layernorm`` / ``k_layernorm`` (Qwen3's per-head RMSNorm):
        inside :meth:`_zero_out_qkv` the decision channels of the norm's input are multiplied by
        the zero-out scale (:meth:`_scale_borrowed`), instead of the norm's output.

        Why before the norm: the RMS of a head is taken over all its channels, the borrowed one
        included, so the other channels' normalised values depend on it. Scaling after the norm
        would leave that coupling in place, and zeroing the producing rows at the hand-off
        (:func:`zero_decision_rows_`) would change every channel of those heads: the model
        after the hand-off would differ from the model at the end of the zero-out phase. Scaled
        before the norm, scale 0 is exactly a zeroed row. (NVIDIA's recipe scales after
        ``q_norm``; this is a deviation for an exact hand-off.)"""
        if self._pre_norm_scale is None:
            return None
        (x,) = args
        return (self._scale_borrowed(x, norm is self.q_layernorm, self._pre_norm_scale),)

    def _scale_borrowed(self, x, is_query, scale):
        """``x [seq, batch, heads, dim]`` (queries or keys) with DMC's borrowed channels, the
        last of every query and key head, multiplied by ``scale``."""
        return scale_decision_channel(x, scale)

    def _decisions(self, alpha_logit):
        """``alpha_logit [batch, kv_heads, seq] -> (alpha, log(1 - alpha_{j+1}))``."""
        cfg = self.dmc.config
        if self.dmc.mode == "eval":
            alpha = (alpha_logit > 0).to(alpha_logit.dtype)
            alpha[..., 0] = 0
            return alpha, log_keep_next(alpha)
        return self._fused(relaxed_decisions)(alpha_logit, self._noise(alpha_logit), cfg.tau,
                                              cfg.hard)

    def _fused(self, fn):
        """``fn`` (elementwise math of a train or eval forward) compiled by ``torch.compile``
        where ``dmc.compile_elementwise`` is set, one graph per function shared by the
        layers; ``fn`` itself otherwise."""
        return compiled(fn) if self.dmc.config.compile_elementwise else fn

    def _noise(self, alpha_logit):
        """Logistic noise for this rank's KV heads, drawn for all heads of the layer from a
        generator keyed by (seed, layer, step, micro-batch) so TP layouts see the same noise."""
        batch, local_heads, seq = alpha_logit.shape
        total_heads = local_heads * self.world_size
        gen = self.dmc.noise_generator(self.layer_number, alpha_logit.device)
        noise = logistic_noise((batch, total_heads, seq), generator=gen, device=alpha_logit.device)
        first = parallel_state.get_tensor_model_parallel_rank() * local_heads
        return noise[:, first:first + local_heads]

    def _rotate_without_decisions(self, query, key, rotary_pos_emb):
        """``query`` and ``key [seq, batch, heads, dim]`` rotated with their decision channels
        zeroed before and after RoPE, the keys' exactly 0 after (the flex-channel backend's
        premise): for megatron's plain rotate-half RoPE, one pass each way through tables
        without the channel (:func:`dmc.ops.without_decision_channel`), bit for bit what
        zeroing, RoPE and zeroing again give up to the sign of a zero (tests); else (fused,
        interleaved or partial RoPE) those three steps, the query not zeroed after (its
        rotated decision channel meets the keys' zeros only)."""
        if rotary_pos_emb is None:
            return zero_decision_channel(query), zero_decision_channel(key)
        q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                            else (rotary_pos_emb, rotary_pos_emb))
        config = self.config
        if (config.apply_rope_fusion or config.rotary_interleaved
                or config.multi_latent_attention or q_freqs.shape[-1] != query.shape[-1]
                or k_freqs.shape[-1] != key.shape[-1]):
            query, key = self._rotate(zero_decision_channel(query), zero_decision_channel(key),
                                      rotary_pos_emb)
            return query, zero_decision_channel(key)
        rotated = self._fused(rotate)
        return (rotated(query, *self.dmc.decision_free_tables(q_freqs, query.dtype)),
                rotated(key, *self.dmc.decision_free_tables(k_freqs, key.dtype)))

    def _rotate(self, query, key, rotary_pos_emb):
        """RoPE at each token's own position on ``[seq, batch, heads, dim]`` tensors."""
        if rotary_pos_emb is None:
            return query, key
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        q_freqs, k_freqs = rotary_pos_emb
        cp_group = self.pg_collection.cp
        query = apply_rotary_pos_emb(query, q_freqs, config=self.config, cp_group=cp_group)
        key = apply_rotary_pos_emb(key, k_freqs, config=self.config, cp_group=cp_group)
        return query, key

    # ------------------------------------------------------------------ CR statistics
    def _record_kept(self, alpha):
        """Adds this forward's kept slots ``sum(1 - alpha)`` per local KV head to the CR stats
        and returns the differentiable kept slots per sequence and local KV head
        ``[batch, local_kv_heads]``.

        With ``hard_loss`` alpha is rounded straight-through first, as in NVIDIA's loss
        (``get_decisions``): the loss and the stats count rounded decisions while the gradient
        is that of the soft alphas."""
        kept = self._kept(alpha)
        self.cr_kept += kept.detach().sum(dim=0).double()
        self.cr_count += alpha.shape[0] * alpha.shape[2]
        return kept

    def _kept(self, alpha):
        """``alpha [batch, kv_heads, seq] ->`` kept slots ``sum(1 - alpha)`` per sequence and
        head ``[batch, kv_heads]``, rounded straight-through under ``hard_loss``."""
        return (1 - self._loss_alpha(alpha)).sum(dim=2)

    def _loss_alpha(self, alpha):
        """The decisions the CR losses see: ``alpha`` in float32, rounded straight-through
        under ``hard_loss``."""
        if self.dmc.config.hard_loss:
            alpha = straight_through_round(alpha)
        return alpha.float()

    def reset_cr_stats(self) -> None:
        self.cr_kept.zero_()
        self.cr_count.zero_()

    def measured_cr(self) -> torch.Tensor:
        """``[local_kv_heads]`` measured compression ratio n / (kept slots) since the last reset."""
        return self.cr_count / self.cr_kept.clamp_min(1e-12)


@functools.cache
def compiled(fn):
    """``torch.compile(fn)``, made once per function (compiled for the first shapes it sees; a
    dimension that then changes, the heads of queries against keys, an eval length, is
    compiled once more as dynamic)."""
    return torch.compile(fn)


def decision_rows(module: "DMCSelfAttention") -> list[int]:
    """Rows of ``module.linear_qkv`` (this rank's shard) that produce the borrowed decision
    channels. The fused weight is grouped per query group as ``[q_1 .. q_G, k, v]`` (``dim``
    rows each). DMC: q[..., -1] of every query head (omega) and k[..., -1] of every KV head
    (alpha). DMS (``module.method == "dms"``): q[..., -1] of the first query head of each group
    only (its eviction logit, :func:`dmc.ops.split_dms_channels`); none for DMS's adapter
    decisions (``dms_decision: adapter``, which borrow no channel)."""
    if getattr(module, "decision_proj", None) is not None:
        return []
    dim = module.hidden_size_per_attention_head
    groups = module.num_query_groups_per_partition
    per_group = module.num_attention_heads_per_partition // groups
    borrowed = 1 if module.method == "dms" else per_group + 1
    return [g * (per_group + 2) * dim + i * dim + dim - 1
            for g in range(groups) for i in range(borrowed)]


def zero_decision_rows_(model: torch.nn.Module) -> int:
    """Zeroes the :func:`decision_rows` of ``linear_qkv`` in all DMC and DMS layers (each its
    own method's rows): the end of the zero-out phase. A DMS adapter's ``decision_proj`` is
    zeroed instead, with its optimizer main copy (bf16/fp16), so every token starts at logit
    -c as with zeroed rows. Returns the number of layers changed."""
    changed = 0
    for module in dmc_layers(model):
        rows = decision_rows(module)
        with torch.no_grad():
            module.linear_qkv.weight[rows] = 0
            bias = getattr(module.linear_qkv, "bias", None)
            if isinstance(bias, torch.Tensor) and bias.numel():
                bias[rows] = 0
            adapter = getattr(module, "decision_proj", None)
            for param in adapter.parameters() if adapter is not None else ():
                for copy in (param, getattr(param, "main_param", None)):
                    if copy is not None:
                        copy.zero_()
        changed += 1
    return changed


def dmc_layers(model: torch.nn.Module) -> list[DMCSelfAttention]:
    """The DMC and DMS attention layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, DMCSelfAttention)]
