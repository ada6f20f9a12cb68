"""The modes of the decode benchmark (``benchmarks/decode_throughput.py``): their ``--modes``
syntax and the models that serve them, random ones (vanilla, GQA, DMC, DMC with delayed merging
and DMS with forced decisions) or a trained checkpoint."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch


class Mode(NamedTuple):
    """One row of the benchmark: ``kind`` is vanilla, dmc, delay (DMC with delayed merging), dms,
    gqa, policy or model; ``value`` the target CR (dmc, delay, dms, policy) or GQA factor;
    ``policy`` the policy name; ``overlap``: served with ``Engine(overlap=True)``."""

    kind: str
    value: float = 1.0
    policy: str = ""
    overlap: bool = False

    @property
    def label(self) -> str:
        return self._name() + (" overlap" if self.overlap else "")

    def _name(self) -> str:
        if self.kind in ("dmc", "dms", "gqa"):
            return f"{self.kind} {self.value:g}x"
        if self.kind == "delay":
            return f"dmc delay {self.value:g}x"
        if self.kind == "policy":
            return f"{self.policy} {self.value:g}x"
        return self.kind


MODE_SYNTAX = "vanilla, model, dmc:CR, delay:CR, dms:CR, gqa:FACTOR, policy:NAME:CR"
FORCED = ("dmc", "delay", "dms")  # random models with forced decisions


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
    if kind in FORCED + ("gqa",) and len(values) == 1 and number and number > 1:
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
    policy serves one engine: each engine gets a new one). Sets ``args.head_dim`` (and with
    ``args.model`` the shape fields) to the models'."""
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
        args.vocab, args.head_dim = config.vocab_size, config.head_dim
    else:
        base = build_model_from_config(model_config(args, args.groups), **QKV_BIAS)
        args.head_dim = args.hidden // args.heads
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
            dmc = (DMCConfig(method="dms", dms_window=args.dms_window, c=args.c)
                   if mode.kind == "dms" else
                   DMCConfig(window=args.window or None, c=args.c,
                             merge_delay=args.merge_delay if mode.kind == "delay" else 0))
            model = build_model_from_config(model_config(args, args.groups), dmc, **QKV_BIAS)
            model.load_state_dict(base.state_dict())
            force_cr(model, mode.value, args)
            models[mode] = (model, "auto", None)
    return models


def window_keep_fraction(cr: float, tokens: int, ring: int) -> float:
    """The fraction of the tokens older than a raw window of ``ring`` tokens that a forced model
    keeps (DMS: not evicted; delayed DMC: appended, not merged) so that its CR after ``tokens``
    tokens is ``cr``: a query holds the ``ring`` tokens of its window whatever their decisions,
    plus the kept ones of the ``tokens - ring`` older; 0 when even the window alone is more than
    ``tokens / cr``."""
    older = tokens - ring
    return min(1.0, max(0.0, (tokens / cr - ring) / older)) if older > 0 else 1.0


@torch.no_grad()
def force_cr(model, cr: float, args) -> None:
    """Set the decision rows of every DMC or DMS layer so that the model compresses about
    ``cr``-fold. DMC: a fraction ``1 - 1/cr`` of calibration tokens merges (the k[-1] row of each
    KV head random, its bias from the calibration forward; the q[-1] rows zeroed: uniform
    importance); under ``merge_delay`` d a fraction ``1 -`` :func:`window_keep_fraction` (ring
    d + 1), which reaches ``cr`` at the full length P + G. DMS: the borrowed row (q[-1] of the
    first query head of each KV group, pre-RoPE: :func:`~dmc.megatron.attention.decision_rows`)
    random, its bias such that ``q[-1] * dms_logit_scale - c > 0`` (evict) for a fraction ``1 -``
    :func:`window_keep_fraction` of tokens (ring w + 1). Layer by layer, in order: earlier
    decisions change later hidden states."""
    from dmc.megatron.attention import decision_rows, dmc_layers

    gen = torch.Generator().manual_seed(args.seed + 1)
    calib = torch.randint(0, args.vocab, (8, min(args.prompt_len + args.gen_len, 1024)),
                          generator=gen)
    device = next(model.parameters()).device
    calib = calib.to(device)
    positions = torch.arange(calib.shape[1], device=device).expand_as(calib)
    for layer in dmc_layers(model):
        weight, bias = layer.linear_qkv.weight, layer.linear_qkv.bias
        rows = decision_rows(layer)
        if layer.method == "dms":
            config = layer.dmc.config
            quantile = window_keep_fraction(cr, args.prompt_len + args.gen_len,
                                            config.dms_window + 1)
            offset = config.c / config.dms_logit_scale
        else:
            per_group = len(rows) // layer.num_query_groups_per_partition
            weight[rows], bias[rows] = 0, 0  # q[-1] rows: omega = sigmoid(c) for every token
            rows = rows[per_group - 1::per_group]  # the k[-1] rows
            delay = layer.dmc.config.merge_delay
            quantile = (window_keep_fraction(cr, args.prompt_len + args.gen_len, delay + 1)
                        if delay else 1.0 / cr)
            offset = args.c
        for row in rows:
            weight[row] = torch.randn(weight.shape[1], generator=gen).to(weight) / math.sqrt(
                weight.shape[1])
        bias[rows] = 0
        captured = []
        hook = layer.linear_qkv.register_forward_hook(
            lambda mod, inp, out: captured.append(out[0][..., rows].float()))
        model(calib, positions, None)
        hook.remove()
        threshold = torch.quantile(captured[0].reshape(-1, len(rows)), quantile, dim=0)
        bias[rows] = (offset - threshold).to(bias)
