"""A Llama model with Dynamic Memory Compression (Nawrot et al., 2024) for Hugging Face transformers.

Self-contained (imports torch and transformers only): ``dmc convert mcore-to-hf`` copies this file
into an exported folder and points ``config.json``'s ``auto_map`` at it, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the model.

Attention is DMC in eval mode (Algorithm 1 of the paper, hard decisions), the semantics of
``dmc.inference.Engine``:

* decision and importance come from the **last** channel of each head (NVIDIA's convention):
  ``alpha_t = [k_t[-1] - c > 0]`` with ``alpha_0 = 0`` (1 = merge into the open slot) and
  ``omega_t = sigmoid(mean over the query group of q_t[-1] + c) + omega_offset`` floored at
  ``1e-6`` (the offset is 2^-7 for models converted from NVIDIA's release, 0 otherwise); both
  channels are zeroed before and after RoPE;
* a merge makes the open slot the omega-weighted mean of the pre-RoPE keys and values of its last
  ``window`` tokens (Eq. 9, window-grouped; ``window: null`` = the exact running mean);
* a slot's key is rotated at the position of its newest token; a query sees every closed slot and
  the open one.

Without a cache (or with an empty one) a forward computes all positions at once with the
hard-decision mask (App. H): key ``j < i`` is visible to query ``i`` only if token ``j + 1``
appended. :class:`DMCCache` holds the compressed cache that ``generate()`` uses: per (layer,
sequence, KV head) a variable number of slots, padded to the longest head and masked per head.
Left padding is supported (a 2-D ``attention_mask`` of zeros followed by ones per row).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

OMEGA_MIN = 1e-6


class DMCLlamaConfig(PretrainedConfig):
    """Llama hyper-parameters plus the DMC settings.

    dmc_window: accumulation window w (None = exact running mean). dmc_c: decision offset c.
    dmc_omega_offset: added to omega (2^-7 in NVIDIA's models, 0 in the paper's).
    dmc_channel: which head channel carries the decision/importance logits (only "last").
    dmc_target_cr, dmc_measured_cr: the training target and the CR measured at export (or None).
    rope_llama3_scaling: None or {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (Llama 3.x frequency scaling).
    """

    model_type = "dmc_llama"

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                 rms_norm_eps=1e-5, rope_theta=10000.0, rope_llama3_scaling=None,
                 max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
                 dmc_window=12, dmc_c=5.0, dmc_omega_offset=0.0, dmc_channel="last",
                 dmc_target_cr=None, dmc_measured_cr=None, use_cache=True, **kwargs):
        if dmc_channel != "last":
            raise ValueError(f"dmc_channel must be 'last', got {dmc_channel!r}")
        if dmc_window is not None and int(dmc_window) < 1:
            raise ValueError(f"dmc_window must be null or >= 1, got {dmc_window!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_llama3_scaling = rope_llama3_scaling
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.dmc_window = dmc_window
        self.dmc_c = dmc_c
        self.dmc_omega_offset = dmc_omega_offset
        self.dmc_channel = dmc_channel
        self.dmc_target_cr = dmc_target_cr
        self.dmc_measured_cr = dmc_measured_cr
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# ----------------------------------------------------------------------------- math
def rope_inv_freq(config: DMCLlamaConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 RoPE frequencies, with Llama 3.x scaling when configured."""
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                             / head_dim))
    scaling = config.rope_llama3_scaling
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x [batch, heads, seq, dim]`` float32, ``positions [batch, seq]``."""
    angles = positions.float()[:, None, :, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def zero_last_channel(x: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    keep[-1] = 0
    return x * keep


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``out[:, :, i] = x[:, :, i - by]``, zero-filled (dim 2)."""
    if by == 0:
        return x
    pad = x.new_zeros(x.shape[:2] + (by,) + x.shape[3:])
    return torch.cat([pad, x[:, :, : x.shape[2] - by]], dim=2)


def accumulate(k, v, alpha, omega, window):
    """Partial accumulation (Eq. 9) of ``k, v [batch, heads, seq, dim]`` with hard ``alpha`` and
    ``omega [batch, heads, seq]``: the omega-weighted mean over the current merge segment,
    truncated to its last ``window`` tokens (None = whole segment). Float32."""
    seq = k.shape[2]
    if window is None:
        outs_k, outs_v = [], []
        z = torch.zeros_like(omega[..., 0])
        mean_k, mean_v = torch.zeros_like(k[:, :, 0]), torch.zeros_like(v[:, :, 0])
        for i in range(seq):
            carry = alpha[..., i] * z
            z = carry + omega[..., i]
            keep, new = (carry / z)[..., None], (omega[..., i] / z)[..., None]
            mean_k = keep * mean_k + new * k[:, :, i]
            mean_v = keep * mean_v + new * v[:, :, i]
            outs_k.append(mean_k)
            outs_v.append(mean_v)
        return torch.stack(outs_k, 2), torch.stack(outs_v, 2)
    decay = torch.ones_like(alpha)
    z = torch.zeros_like(alpha)
    num_k, num_v = torch.zeros_like(k), torch.zeros_like(v)
    for offset in range(min(window, seq)):
        if offset:
            decay = decay * _shift(alpha, offset - 1)
        coeff = decay * _shift(omega, offset)
        z = z + coeff
        num_k = num_k + coeff[..., None] * _shift(k, offset)
        num_v = num_v + coeff[..., None] * _shift(v, offset)
    return num_k / z[..., None], num_v / z[..., None]


# ----------------------------------------------------------------------------- cache
class DMCCacheLayer(CacheLayerMixin):
    """The compressed cache of one layer.

    keys, values: ``[batch, kv_heads, capacity, dim]`` slots (keys rotated, decision channel 0);
    lengths: ``[batch, kv_heads]`` slots per head; open-slot state for Eq. 9: ``ring_k, ring_v
    [batch, kv_heads, rows, dim]`` pre-RoPE (rows = window, or 1 holding the running mean),
    ``ring_omega [batch, kv_heads, rows]`` (the weights, or z), ``count [batch, kv_heads]`` tokens
    merged into the open slot.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window
        self.lengths = self.ring_k = self.ring_v = self.ring_omega = self.count = None

    @property
    def rows(self) -> int:
        return self.window or 1

    def lazy_initialization(self, key_states, value_states) -> None:
        batch, heads, _, dim = key_states.shape
        device = key_states.device
        self.keys = key_states.new_zeros(batch, heads, 0, dim)
        self.values = value_states.new_zeros(batch, heads, 0, dim)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=device)
        self.ring_k = torch.zeros(batch, heads, self.rows, dim, device=device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.ring_omega = torch.zeros(batch, heads, self.rows, device=device)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("DMCCacheLayer is written by DMC attention (fill / merge_token),"
                                  " not by update()")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.keys.shape[2] if self.is_initialized else 0) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.lengths.max()) if self.is_initialized and self.lengths.numel() else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.window)

    def _select(self, index: torch.Tensor) -> None:
        for name in ("keys", "values", "lengths", "ring_k", "ring_v", "ring_omega", "count"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            batch = self.keys.shape[0]
            self._select(torch.arange(batch).repeat_interleave(repeats))

    def _reserve(self, slots: int) -> None:
        """Grows ``keys``/``values`` to hold ``slots`` slots per head (doubling)."""
        capacity = self.keys.shape[2]
        if slots <= capacity:
            return
        grow = max(slots, 2 * capacity) - capacity
        pad = self.keys.new_zeros(self.keys.shape[:2] + (grow, self.keys.shape[3]))
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad.to(self.values.dtype)], dim=2)

    def fill(self, keys, values, ends, k_pre, v_pre, omega, alpha, real, k_acc, v_acc):
        """Packs a prefilled sequence into an empty layer cache.

        keys, values: ``[batch, kv, n, dim]`` every token's rotated key and accumulated value;
        ends ``[batch, kv, n]`` marks the tokens that close a slot (the last real token of each
        merge segment); k_pre, v_pre ``[batch, kv, n, dim]`` pre-RoPE zeroed keys and values;
        omega, alpha ``[batch, kv, n]``; real ``[batch, n]``; k_acc, v_acc the pre-RoPE means.
        """
        batch, heads, n, dim = keys.shape
        self.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        self.lengths = ends.sum(-1)
        most = int(self.lengths.max()) if n else 0
        position = torch.arange(n, device=keys.device).expand_as(ends)
        order = torch.where(ends, position, n).sort(dim=-1).values[..., :most].clamp(max=n - 1)
        index = order[..., None].expand(batch, heads, most, dim)
        self.keys = keys.gather(2, index)
        self.values = values.gather(2, index)
        starts = (alpha <= 0.5) & real[:, None, :]
        last_start = torch.where(starts, position, -1).max(dim=-1).values
        self.count = torch.where(last_start >= 0, n - last_start, 0)
        if self.window is None:
            in_segment = (position >= last_start[..., None]) & real[:, None, :]
            self.ring_k = k_acc[:, :, -1:].float().clone()
            self.ring_v = v_acc[:, :, -1:].float().clone()
            self.ring_omega = (omega * in_segment).sum(-1, keepdim=True).float()
            return
        rows = torch.arange(self.window, device=keys.device)
        # ring row r holds the segment's newest token j with j % window == r
        j = rows + self.window * torch.div(self.count[..., None] - 1 - rows, self.window,
                                           rounding_mode="floor")
        valid = (j >= 0) & (self.count[..., None] > 0)
        t = torch.where(valid, last_start[..., None] + j, 0)
        index = t[..., None].expand(batch, heads, self.window, dim)
        self.ring_k = torch.where(valid[..., None], k_pre.float().gather(2, index), 0.0)
        self.ring_v = torch.where(valid[..., None], v_pre.float().gather(2, index), 0.0)
        self.ring_omega = torch.where(valid, omega.float().gather(2, t), 0.0)

    def merge_token(self, k, v, omega, append, positions, inv_freq):
        """Algorithm 1 for one token per (sequence, KV head): ``k, v [batch, kv, dim]`` pre-RoPE
        (zeroed channel), ``omega [batch, kv]``, ``append [batch, kv]`` bool, ``positions
        [batch]``. Opens a slot or merges into the open one (Eq. 9), then stores the slot's mean
        key rotated at ``positions``."""
        k, v, omega = k.float(), v.float(), omega.float()
        count = torch.where(append, 0, self.count)
        if self.window is None:
            z = torch.where(append, 0.0, self.ring_omega[..., 0])
            z_new = z + omega
            mean_k = (z[..., None] * self.ring_k[:, :, 0] + omega[..., None] * k) / z_new[..., None]
            mean_v = (z[..., None] * self.ring_v[:, :, 0] + omega[..., None] * v) / z_new[..., None]
            self.ring_k[:, :, 0], self.ring_v[:, :, 0], self.ring_omega[..., 0] = mean_k, mean_v, z_new
        else:
            ring = (count % self.window)[..., None]
            self.ring_k.scatter_(2, ring[..., None].expand_as(self.ring_k[:, :, :1]), k[:, :, None])
            self.ring_v.scatter_(2, ring[..., None].expand_as(self.ring_v[:, :, :1]), v[:, :, None])
            self.ring_omega.scatter_(2, ring, omega[..., None])
            rows = torch.arange(self.window, device=k.device)
            valid = rows < torch.clamp(count + 1, max=self.window)[..., None]
            weights = torch.where(valid, self.ring_omega, 0.0)
            total = weights.sum(-1, keepdim=True)
            mean_k = torch.einsum("bhw,bhwd->bhd", weights, self.ring_k) / total
            mean_v = torch.einsum("bhw,bhwd->bhd", weights, self.ring_v) / total
        self.count = count + 1
        slot = torch.where(append, self.lengths, self.lengths - 1)
        self.lengths = torch.where(append, self.lengths + 1, self.lengths)
        self._reserve(int(self.lengths.max()))
        rotated = zero_last_channel(apply_rope(mean_k[:, :, None], positions[:, None], inv_freq))
        index = slot[..., None, None].expand(-1, -1, 1, k.shape[-1])
        self.keys.scatter_(2, index, rotated.to(self.keys.dtype))
        self.values.scatter_(2, index, mean_v[:, :, None].to(self.values.dtype))


class DMCCache(Cache):
    """Compressed KV cache of a :class:`DMCLlamaForCausalLM`: one :class:`DMCCacheLayer` per
    layer plus, per sequence, the tokens seen (``seen``) and real (unpadded) tokens seen
    (``next_position [batch]``, the RoPE position of the next token)."""

    def __init__(self, config: DMCLlamaConfig):
        super().__init__(layers=[DMCCacheLayer(config.dmc_window)
                                 for _ in range(config.num_hidden_layers)])
        self.seen = 0
        self.next_position = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self):
        super().reset()
        self.seen, self.next_position = 0, None

    def _select(self, index: torch.Tensor) -> None:
        if self.next_position is not None:
            self.next_position = self.next_position.index_select(
                0, index.to(self.next_position.device))

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._select(beam_idx)

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.next_position is not None:
            self.next_position = self.next_position.repeat_interleave(repeats)

    def slot_counts(self) -> torch.Tensor:
        """``[layers, batch, kv_heads]`` slots held per head."""
        return torch.stack([layer.lengths for layer in self.layers])


# ----------------------------------------------------------------------------- modules
class DMCRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DMCMLP(nn.Module):
    def __init__(self, config: DMCLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DMCAttention(nn.Module):
    """Eval-mode DMC self-attention (see the module docstring)."""

    def __init__(self, config: DMCLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.head_dim = config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.c = float(config.dmc_c)
        self.omega_offset = float(config.dmc_omega_offset)
        self.window = config.dmc_window
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def _split(self, x, heads):
        batch, n, _ = x.shape
        return x.view(batch, n, heads, self.head_dim).transpose(1, 2).float()

    def forward(self, hidden, positions, real, inv_freq, cache: DMCCacheLayer | None,
                prefill: bool):
        """``hidden [batch, n, hidden]``, ``positions [batch, n]``, ``real [batch, n]`` bool.
        ``prefill``: the cache (if any) is empty and all ``n`` tokens are processed at once;
        otherwise ``n == 1`` and the token is merged into ``cache``."""
        batch, n, _ = hidden.shape
        q = self._split(self.q_proj(hidden), self.heads)
        k = self._split(self.k_proj(hidden), self.kv_heads)
        v = self._split(self.v_proj(hidden), self.kv_heads)
        alpha = (k[..., -1] - self.c > 0).float()  # [batch, kv, n]
        omega_logit = q[..., -1].view(batch, self.kv_heads, self.group, n).mean(2)
        omega = (torch.sigmoid(omega_logit + self.c) + self.omega_offset).clamp_min(OMEGA_MIN)
        q, k = zero_last_channel(q), zero_last_channel(k)
        q_rot = zero_last_channel(apply_rope(q, positions, inv_freq))
        if prefill:
            context = self._prefill(q_rot, k, v, alpha, omega, positions, real, inv_freq, cache)
        else:
            append = (alpha[..., 0] <= 0.5) | (cache.lengths == 0)
            cache.merge_token(k[:, :, 0], v[:, :, 0], omega[..., 0], append, positions[:, 0],
                              inv_freq)
            context = self._attend_cache(q_rot, cache)
        context = context.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim)
        return self.o_proj(context.to(hidden.dtype))

    def _prefill(self, q_rot, k, v, alpha, omega, positions, real, inv_freq, cache):
        n = k.shape[2]
        first_real = real.float().argmax(dim=-1)  # left padding: the first real token
        index = torch.arange(n, device=k.device)
        alpha = alpha * (index[None, None] > first_real[:, None, None]).float()
        k_acc, v_acc = accumulate(k, v, alpha, omega, self.window)
        keys = zero_last_channel(apply_rope(k_acc, positions, inv_freq))
        closes = torch.ones_like(alpha, dtype=torch.bool)
        closes[..., :-1] = alpha[..., 1:] <= 0.5  # token j's slot closes when j + 1 appends
        visible = closes[..., None, :] & real[:, None, None, :] & (index[None, :] < index[:, None])
        visible = visible | torch.eye(n, dtype=torch.bool, device=k.device)
        scores = torch.einsum("bhgqd,bhkd->bhgqk",
                              q_rot.view(q_rot.shape[0], self.kv_heads, self.group, n, -1),
                              keys) * self.scale
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        context = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1), v_acc)
        if cache is not None:
            cache.fill(keys, v_acc, closes & real[:, None, :], k, v, omega, alpha, real, k_acc,
                       v_acc)
        return context.reshape(q_rot.shape)

    def _attend_cache(self, q_rot, cache: DMCCacheLayer):
        """One query per sequence over each head's slots: ``q_rot [batch, heads, 1, dim]``."""
        most = int(cache.lengths.max())
        keys, values = cache.keys[:, :, :most].float(), cache.values[:, :, :most].float()
        batch = q_rot.shape[0]
        q = q_rot.view(batch, self.kv_heads, self.group, -1)
        scores = torch.einsum("bhgd,bhsd->bhgs", q, keys) * self.scale
        valid = torch.arange(most, device=q.device) < cache.lengths[..., None]
        scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
        context = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), values)
        return context.reshape(batch, self.heads, 1, -1)


class DMCDecoderLayer(nn.Module):
    def __init__(self, config: DMCLlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DMCRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DMCAttention(config, layer_idx)
        self.post_attention_layernorm = DMCRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DMCMLP(config)

    def forward(self, x, positions, real, inv_freq, cache, prefill):
        x = x + self.self_attn(self.input_layernorm(x), positions, real, inv_freq, cache, prefill)
        return x + self.mlp(self.post_attention_layernorm(x))


class DMCLlamaPreTrainedModel(PreTrainedModel):
    config_class = DMCLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["DMCDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DMCRMSNorm):
            nn.init.ones_(module.weight)


class DMCLlamaModel(DMCLlamaPreTrainedModel):
    def __init__(self, config: DMCLlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DMCDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = DMCRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=False, **kwargs):
        """Hidden states ``[batch, n, hidden]`` and the cache (a :class:`DMCCache` or None)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, n, _ = inputs_embeds.shape
        cache = _as_dmc_cache(past_key_values, self.config) if use_cache else None
        prefill = cache is None or cache.seen == 0
        real = _real_tokens(attention_mask, batch, n, inputs_embeds.device, prefill)
        if prefill:
            if position_ids is None:
                position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
            hidden = self._run(inputs_embeds, position_ids, real, cache, True)
            if cache is not None:
                cache.next_position = real.long().sum(-1)
        else:
            outs = []
            for t in range(n):  # continuing a cache: token by token (Algorithm 1)
                pos = (position_ids[:, t:t + 1] if position_ids is not None
                       else cache.next_position[:, None])
                outs.append(self._run(inputs_embeds[:, t:t + 1], pos, real[:, t:t + 1], cache,
                                      False))
                cache.next_position = pos[:, 0] + 1
            hidden = torch.cat(outs, dim=1)
        if cache is not None:
            cache.seen += n
        return self.norm(hidden), cache

    def _run(self, x, positions, real, cache, prefill):
        # computed per call: from_pretrained builds modules on the meta device, so a buffer
        # would have to be re-initialised after loading
        inv_freq = rope_inv_freq(self.config, self.head_dim).to(x.device)
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            x = layer(x, positions.to(x.device), real, inv_freq, layer_cache, prefill)
        return x


def _as_dmc_cache(cache, config) -> DMCCache:
    """The cache to use: a DMCCache as given, a new one for None or an empty foreign cache
    (``generate()`` creates a ``DynamicCache``)."""
    if isinstance(cache, DMCCache):
        return cache
    if cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0):
        return DMCCache(config)
    raise ValueError(f"DMC models need a DMCCache (or none), got a filled {type(cache).__name__}")


def _real_tokens(attention_mask, batch, n, device, prefill) -> torch.Tensor:
    """``[batch, n]`` bool: the new tokens that are not padding. Only left padding (zeros then
    ones per row) is supported, and tokens after the prompt must be real."""
    if attention_mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError("DMC models take a 2-D attention_mask [batch, seq] (1 = token, 0 = pad)")
    mask = attention_mask[:, -n:].to(device).bool()
    if prefill:
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError("DMC models support left padding only: attention_mask rows must be "
                             "zeros followed by ones")
    elif not mask.all():
        raise ValueError("DMC models: tokens after the prompt must not be padding")
    return mask


class DMCLlamaForCausalLM(DMCLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DMCLlamaConfig):
        super().__init__(config)
        self.model = DMCLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """Causal-LM logits ``[batch, n, vocab]`` (float32 cast of the head's output), loss for
        ``labels`` (shifted inside), and the compressed cache when ``use_cache``."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        hidden, cache = self.model(input_ids, attention_mask, position_ids, past_key_values,
                                   inputs_embeds, use_cache=use_cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
