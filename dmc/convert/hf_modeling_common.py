"""The parts of the exported DMC and DMS models for Hugging Face transformers that do not depend on
the method: the Llama hyper-parameters of the config (:class:`CompressedLlamaConfig`), the Llama
blocks (RMSNorm, SwiGLU MLP, pre-norm decoder layer), the ``[batch, n]`` real-token mask of a
left-padded batch, the model body that runs a prefill at once and a continued cache token by
token, and the causal-LM head.

Shipped as ``hf_modeling_common.py`` next to ``modeling_dmc.py`` / ``modeling_dms.py`` (which
import it relatively) by ``dmc convert mcore-to-hf``. A method module subclasses
:class:`CompressedLlamaModel` and :class:`CompressedLlamaForCausalLM`, naming its attention class
(``attention(config, layer_idx)``, forward ``(hidden, positions [batch, n], real [batch, n],
inv_freq, layer cache or None, prefill) -> hidden``) and its cache class (with ``seen``,
``next_position`` and ``layers``, see :class:`dmc.convert.hf_modeling_dmc.DMCCache`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # the exported folder
    from .rope import rope_inv_freq
except ImportError:  # imported from the dmc package
    from dmc.ops.rope import rope_inv_freq


class CompressedCacheLayer(CacheLayerMixin):
    """What the cache layers of the compressed methods share: written by their attention (not
    by ``update``), ``keys [batch, kv_heads, capacity, dim]`` with ``lengths [batch, kv_heads]``
    entries per head, and per-sequence tensors named in ``state_names`` that beam search and
    batch selection reorder along the batch. ``window`` is the method's one constructor
    argument (``reset`` rebuilds the layer with it)."""

    is_compileable = False
    is_croppable = False
    state_names: tuple[str, ...] = ()

    def __init__(self, window):
        super().__init__()
        self.window = window
        self.lengths = None

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is written by its attention (fill, "
                                  f"then one token at a time), not by update()")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.keys.shape[2] if self.is_initialized else 0) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.lengths.max()) if self.is_initialized and self.lengths.numel() else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.window)

    def crop(self, max_length: int) -> None:  # assisted decoding: merges cannot be undone
        raise NotImplementedError(f"a compressed cache cannot be cut back to {max_length} tokens")

    def _select(self, index: torch.Tensor) -> None:
        for name in self.state_names:
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))


class CompressedCache(Cache):
    """KV cache of a compressed model: one method-specific cache layer per model layer (each
    with ``lengths [batch, kv_heads]``, the entries a head holds) plus, per sequence, the tokens
    seen (``seen``) and the RoPE position of the next real (unpadded) token
    (``next_position [batch]``). A method module subclasses it to build its layers."""

    def __init__(self, layers: list):
        super().__init__(layers=layers)
        self.seen, self.next_position = 0, None

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
        """``[layers, batch, kv_heads]`` entries held per head (a layer's ``held()`` where it
        has one, else its ``lengths``)."""
        return torch.stack([layer.held() if hasattr(layer, "held") else layer.lengths
                            for layer in self.layers])


class CompressedLlamaConfig(PretrainedConfig):
    """The Llama hyper-parameters both methods' configs share (a method's config subclasses it
    and adds its own settings).

    rope_llama3_scaling: None or {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (Llama 3.x frequency scaling).
    head_dim: channels per head (None = hidden_size / num_attention_heads). qk_norm: Qwen3's
    per-head RMSNorm of queries and keys before RoPE (and before a decision is read).
    """

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                 rms_norm_eps=1e-6, rope_theta=10000.0, rope_llama3_scaling=None,
                 max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
                 use_cache=True, head_dim=None, qk_norm=False, **kwargs):
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
        self.use_cache = use_cache
        self.head_dim = head_dim
        self.qk_norm = bool(qk_norm)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def head_dim_of(config) -> int:
    """Channels per head: the config's ``head_dim`` (Qwen3-style models set it, e.g. 128 with
    hidden 1024 and 16 heads), else ``hidden_size // num_attention_heads`` (Llama)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CompressedAttention(nn.Module):
    """The projections and head split of an eval-mode compressed attention layer (Llama's
    q/k/v/o without biases; with the config's ``qk_norm`` also Qwen3's per-head RMSNorms
    ``q_norm`` / ``k_norm`` ``[head_dim]``, applied after the projection and before RoPE and
    any decision channel is read); a method module adds its decisions, cache and ``forward``."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim ** -0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        if getattr(config, "qk_norm", False):
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _split(self, x, heads, norm=None):
        """``[batch, n, heads * dim] -> [batch, heads, n, dim]`` in float32, each head through
        ``norm`` (``q_norm`` / ``k_norm``) first when given."""
        batch, n, _ = x.shape
        x = x.view(batch, n, heads, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2).float()

    def _queries(self, hidden):
        """``q_norm(q_proj(hidden))`` as ``[batch, heads, n, dim]`` float32 (before RoPE)."""
        return self._split(self.q_proj(hidden), self.heads, self.q_norm)

    def _keys(self, hidden):
        """``k_norm(k_proj(hidden))`` as ``[batch, kv_heads, n, dim]`` float32 (before RoPE)."""
        return self._split(self.k_proj(hidden), self.kv_heads, self.k_norm)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block around the method's attention class."""

    def __init__(self, config, layer_idx: int, attention):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, real, inv_freq, cache, prefill):
        x = x + self.self_attn(self.input_layernorm(x), positions, real, inv_freq, cache, prefill)
        return x + self.mlp(self.post_attention_layernorm(x))


class CompressedPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class CompressedLlamaModel(CompressedPreTrainedModel):
    """Embedding, decoder layers and final norm; subclasses set ``attention_class`` and
    ``cache_class``."""

    attention_class = None
    cache_class = None

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.attention_class)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim = head_dim_of(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=False, **kwargs):
        """Hidden states ``[batch, n, hidden]`` and the cache (a ``cache_class`` or None). A
        ``past_key_values`` given is read and extended whatever ``use_cache`` says, as Llama's
        model does (dropping it ran the new tokens as a sequence of their own)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cache = (as_cache(past_key_values, self.config, self.cache_class)
                 if use_cache or past_key_values is not None else None)
        return run_model(self, inputs_embeds, attention_mask, position_ids, cache)


class CompressedLlamaForCausalLM(CompressedPreTrainedModel, GenerationMixin):
    """A :class:`CompressedLlamaModel` (``model_class``) and the LM head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    model_class = None

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
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
        asked = [f for f in ("output_attentions", "output_hidden_states")
                 if kwargs.get(f, getattr(self.config, f, False))]
        if asked:
            raise NotImplementedError(f"{', '.join(asked)}: only logits and the cache are returned")
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


def real_tokens(attention_mask, batch, n, device, prefill) -> torch.Tensor:
    """``[batch, n]`` bool: the new tokens that are not padding. Only left padding (zeros then
    ones per row) is supported, and tokens after the prompt must be real."""
    if attention_mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError("compressed models take a 2-D attention_mask [batch, seq] (1 = token)")
    mask = attention_mask[:, -n:].to(device).bool()
    if prefill:
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError("compressed models support left padding only: attention_mask rows "
                             "must be zeros followed by ones")
    elif not mask.all():
        raise ValueError("compressed models: tokens after the prompt must not be padding")
    return mask


def run_model(model, inputs_embeds, attention_mask, position_ids, cache):
    """The body of a compressed model's forward: ``(hidden [batch, n, hidden] after the final
    norm, cache)``. An empty (or no) cache: all tokens at once (prefill); a filled one: token by
    token. ``model`` has ``layers``, ``norm``, ``head_dim`` and ``config``."""
    batch, n, _ = inputs_embeds.shape
    prefill = cache is None or cache.seen == 0
    real = real_tokens(attention_mask, batch, n, inputs_embeds.device, prefill)
    if prefill:
        if position_ids is None:
            position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
        hidden = _run_layers(model, inputs_embeds, position_ids, real, cache, True)
        if cache is not None:
            cache.next_position = real.long().sum(-1)
    else:
        outs = []
        for t in range(n):
            pos = (position_ids[:, t:t + 1] if position_ids is not None
                   else cache.next_position[:, None])
            outs.append(_run_layers(model, inputs_embeds[:, t:t + 1], pos, real[:, t:t + 1],
                                    cache, False))
            cache.next_position = pos[:, 0] + 1
        hidden = torch.cat(outs, dim=1)
    if cache is not None:
        cache.seen += n
    return model.norm(hidden), cache


def _run_layers(model, x, positions, real, cache, prefill):
    # per call: from_pretrained builds modules on the meta device, where a buffer stays unset
    inv_freq = rope_inv_freq(model.head_dim, model.config.rope_theta,
                             llama3_scaling=model.config.rope_llama3_scaling).to(x.device)
    for i, layer in enumerate(model.layers):
        layer_cache = cache.layers[i] if cache is not None else None
        x = layer(x, positions.to(x.device), real, inv_freq, layer_cache, prefill)
    return x


def as_cache(cache, config, cache_class):
    """The cache to use: a ``cache_class`` as given, a new one for None or an empty foreign
    cache (``generate()`` creates a ``DynamicCache``)."""
    if isinstance(cache, cache_class):
        return cache
    if cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0):
        return cache_class(config)
    raise ValueError(f"this model needs a {cache_class.__name__} (or none), got a filled "
                     f"{type(cache).__name__}")
