"""The modes of the decode benchmark (``benchmarks/decode_throughput.py``): their ``--modes``
syntax and the models that serve them, random ones (vanilla, GQA, DMC with forced decisions) or
a trained checkpoint."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch


class Mode(NamedTuple):
    """One row of the benchmark: ``kind`` is vanilla, dmc, gqa, policy or model; ``value`` the
    target CR (dmc, policy) or GQA factor; ``policy`` the policy name."""

    kind: str
    value: float = 1.0
    policy: str = ""

    @property
    def label(self) -> str:
        if self.kind == "dmc":
            return f"dmc {self.value:g}x"
        if self.kind == "gqa":
            return f"gqa {self.value:g}x"
        if self.kind == "policy":
            return f"{self.policy} {self.value:g}x"
        return self.kind


MODE_SYNTAX = "vanilla, model, dmc:CR, gqa:FACTOR, policy:NAME:CR"


def parse_mode(text: str) -> Mode:
    """A :class:`Mode` from ``--modes`` syntax; ValueError naming the accepted forms."""
    from dmc.policies import SPEC_SYNTAX, parse_policy_spec

    kind, *values = text.strip().split(":")
    if kind == "policy" and len(values) == 2:
        try:
            parse_policy_spec(values[0])
        except ValueError as err:
            raise ValueError(f"--modes: {err} in {text!r}; NAME is spelled {SPEC_SYNTAX}"
                             ) from None
    try:
        number = float(values[-1]) if values else None
    except ValueError:
        number = None
    if kind in ("vanilla", "model") and not values:
        return Mode(kind)
    if kind in ("dmc", "gqa") and len(values) == 1 and number and number > 1:
        return Mode(kind, number)
    if kind == "policy" and len(values) == 2 and number and number > 1:
        return Mode(kind, number, values[0])
    raise ValueError(f"--modes: bad mode {text!r}; accepted: {MODE_SYNTAX} (CR and FACTOR > 1)")


def model_config(args, groups: int):
    """The random model's :class:`~dmc.megatron.config.ModelConfig` (built with QKV biases:
    :data:`QKV_BIAS`)."""
    from dmc.megatron.config import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                       num_query_groups=groups, vocab_size=args.vocab,
                       max_seq_length=args.prompt_len + args.gen_len, params_dtype=args.dtype)


QKV_BIAS = {"add_qkv_bias": True}  # the random models' TransformerConfig override


def build_models(args) -> dict:
    """``{mode: (model, dmc argument of the Engine, policy factory or None)}`` for every mode (a
    policy serves one engine: each engine gets a new one)."""
    from dmc.megatron.config import DMCConfig
    from dmc.megatron.model import build_model_from_config
    from dmc.policies import policy_from_spec

    torch.manual_seed(args.seed)
    if args.model:
        from dmc.inference.loading import load_model

        loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
        base = loaded.model.to("cuda" if args.cuda else "cpu")
        config = loaded.model_config
        args.layers, args.hidden = config.num_layers, config.hidden_size
        args.heads, args.groups = config.num_attention_heads, config.kv_heads
        args.vocab = config.vocab_size
    else:
        base = build_model_from_config(model_config(args, args.groups), **QKV_BIAS)
    models = {}
    for mode in args.mode_list:
        if mode.kind == "vanilla":
            models[mode] = (base, None, None)
        elif mode.kind == "model":
            models[mode] = (base, "auto", None)
        elif mode.kind == "policy":
            models[mode] = (base, None, functools.partial(policy_from_spec, mode.policy,
                                                          compression_ratio=mode.value))
        elif mode.kind == "gqa":
            torch.manual_seed(args.seed)
            config = model_config(args, int(args.groups / mode.value))
            models[mode] = (build_model_from_config(config, **QKV_BIAS), None, None)
        else:
            dmc = DMCConfig(window=args.window or None, c=args.c)
            model = build_model_from_config(model_config(args, args.groups), dmc, **QKV_BIAS)
            model.load_state_dict(base.state_dict())
            force_cr(model, mode.value, args)
            models[mode] = (model, "auto", None)
    return models


@torch.no_grad()
def force_cr(model, cr: float, args) -> None:
    """Set the decision rows of every DMC layer so that about ``1 - 1/cr`` of calibration tokens
    merge (see the module docstring)."""
    from dmc.megatron.attention import dmc_layers

    gen = torch.Generator().manual_seed(args.seed + 1)
    calib = torch.randint(0, args.vocab, (8, min(args.prompt_len + args.gen_len, 1024)),
                          generator=gen)
    device = next(model.parameters()).device
    calib = calib.to(device)
    positions = torch.arange(calib.shape[1], device=device).expand_as(calib)
    for layer in dmc_layers(model):
        dim = layer.hidden_size_per_attention_head
        groups = layer.num_query_groups_per_partition
        per_group = layer.num_attention_heads_per_partition // groups
        weight, bias = layer.linear_qkv.weight, layer.linear_qkv.bias
        k_rows = []
        for g in range(groups):
            base = g * (per_group + 2) * dim
            for i in range(per_group):  # q[-1] rows: omega = sigmoid(c) for every token
                weight[base + i * dim + dim - 1] = 0
                bias[base + i * dim + dim - 1] = 0
            k_row = base + per_group * dim + dim - 1
            weight[k_row] = torch.randn(weight.shape[1], generator=gen).to(weight) / math.sqrt(
                weight.shape[1])
            bias[k_row] = 0
            k_rows.append(k_row)
        captured = []
        hook = layer.linear_qkv.register_forward_hook(
            lambda mod, inp, out: captured.append(out[0][..., k_rows].float()))
        model(calib, positions, None)
        hook.remove()
        raw = captured[0].reshape(-1, groups)  # [tokens, groups]
        threshold = torch.quantile(raw, 1.0 / cr, dim=0)
        for g, k_row in enumerate(k_rows):
            bias[k_row] = args.c - threshold[g]
