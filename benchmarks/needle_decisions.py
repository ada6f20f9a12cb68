"""Where a DMC or DMS checkpoint keeps a needle's tokens whole: its eval-mode decisions on needle
prompts, by kind of token (haystack, needle key, needle value).

    python benchmarks/needle_decisions.py CHECKPOINT DATA_DIR [--length 512] [--needles 40]

On ``--needles`` prompts of :func:`dmc.data.needle.make_needle_examples` (DATA_DIR's held-out
split, the needle column's prompts), a plain forward in eval mode (hard decisions, as the engine
takes them) records every layer's decisions ``alpha [batch, kv_heads, seq]``. A token's key and
value are held *whole* by a head when no other token's are mixed into the slot that holds them:

* DMC (Eq. 3-5): token ``t`` appends a slot when ``alpha_t = 0`` and merges into the last slot
  when ``alpha_t = 1``; its slot stays its own only if the next token appends too:
  ``whole_t = (1 - alpha_t) (1 - alpha_{t+1})``. A merged token is averaged with its neighbours;
* DMS: ``alpha_{t+1}`` evicts token ``t`` (once the window has passed): ``whole_t = 1 -
  alpha_{t+1}``; a kept token is never averaged with another.

A token the last prompt query still sees raw is held whole whatever the decisions: within the
last ``dms_window`` tokens under DMS, the last ``merge_delay`` under DMC with delayed merging
(``dmc.merge_delay``). The last prompt token (the query's last key token) is left out. Prints,
per layer, the share of heads x tokens held whole among haystack tokens, the needle's key and
its value, and ``value / haystack`` (above 1: the heads single out the value, a decision that
depends on the content); ``--json PATH`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dmc.data.indexed import read_indexed_dataset
from dmc.data.needle import make_needle_examples
from dmc.inference.loading import load_model
from dmc.megatron.attention import dmc_layers

KINDS = ("haystack", "key", "value")


def held_whole(alpha: torch.Tensor, method: str, raw_from: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``alpha [batch, heads, seq]`` hard decisions -> ``[batch, heads, seq]`` 1 where the
    token's slot holds that token alone (see the module docstring); the last position, whose
    fate the next token decides, is taken as kept by the next decision ``alpha = 0``.
    ``raw_from [batch]``: the first position the query sees raw (a window): from there on
    every token is held whole."""
    following = torch.cat([alpha[..., 1:], torch.zeros_like(alpha[..., :1])], dim=-1)
    if method == "dms":
        whole = 1 - following
    elif method == "dmc":
        whole = (1 - alpha) * (1 - following)
    else:
        raise ValueError(f"method: expected dmc or dms, got {method!r}")
    if raw_from is not None:
        positions = torch.arange(alpha.shape[-1], device=alpha.device)
        whole = torch.where(positions >= raw_from[:, None, None], 1.0, whole)
    return whole


def token_kinds(example, length: int) -> torch.Tensor:
    """``[length]`` 0 haystack, 1 key, 2 value of the needle (its first copy), -1 the query's
    key (the prompt's end) and the answer."""
    kinds = torch.zeros(length, dtype=torch.long)
    key_end = example.needle_start + example.key_len
    kinds[example.needle_start:key_end] = 1
    kinds[key_end:key_end + example.value_len] = 2
    kinds[example.prompt_len - example.key_len:] = -1
    return kinds


def decisions(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each DMC / DMS layer's eval-mode ``alpha [batch, kv_heads, seq]`` on ``tokens``."""
    layers, recorded = dmc_layers(model), []

    def recording(original):
        def run(*args, **kwargs):
            context, alpha = original(*args, **kwargs)
            recorded.append(alpha.detach().float())
            return context, alpha
        return run

    try:
        for layer in layers:  # an instance attribute over the class's method, removed after
            layer._compressed_attention = recording(layer._compressed_attention)
        with torch.no_grad():
            model(tokens, torch.arange(tokens.shape[1])[None], None)
    finally:
        for layer in layers:
            vars(layer).pop("_compressed_attention", None)
    return recorded


def measure(model, method: str, examples, window: int = 0) -> list[dict]:
    """Per layer: the share of heads x tokens held whole for each kind, over ``examples``;
    ``window``: the tokens before the last prompt query that it sees raw (DMS's
    ``dms_window``, DMC's ``merge_delay``; 0: none)."""
    tokens = torch.tensor([list(e.tokens) for e in examples])
    kinds = torch.stack([token_kinds(e, tokens.shape[1]) for e in examples])
    raw_from = torch.tensor([e.prompt_len - 1 - window for e in examples]) if window else None
    rows = []
    for layer, alpha in enumerate(decisions(model, tokens)):
        whole = held_whole(alpha, method, raw_from)  # [batch, heads, seq]
        row = {"layer": layer}
        for index, kind in enumerate(KINDS):
            mask = (kinds == index)[:, None, :].expand_as(whole)
            row[kind] = whole[mask].mean().item()
            row[f"{kind}_per_head"] = [whole[:, h][mask[:, h]].mean().item()
                                       for h in range(whole.shape[1])]
        row["value_over_haystack"] = row["value"] / max(row["haystack"], 1e-9)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data", help="a `dmc data prepare` folder (its valid split is used)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--needles", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    prefix = Path(args.data) / "valid_text_document"
    if not prefix.with_suffix(".idx").is_file():
        print(f"data: {args.data} holds no valid split (valid_text_document.idx); give a "
              f"`dmc data prepare` output folder", file=sys.stderr)
        return 2
    loaded = load_model(args.checkpoint)
    if loaded.dmc_config is None:
        print(f"checkpoint: {args.checkpoint} is a vanilla model; give a DMC or DMS one",
              file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    stream = [t for doc in read_indexed_dataset(str(prefix)) for t in doc]
    examples = make_needle_examples(stream, args.length, args.needles, seed=args.seed)
    config = loaded.dmc_config
    window = config.dms_window if config.method == "dms" else config.merge_delay
    rows = measure(loaded.model.eval(), config.method, examples, window)
    print("| layer | haystack | key | value | value / haystack | value, per head |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        heads = " ".join(f"{v:.2f}" for v in r["value_per_head"])
        print(f"| {r['layer']} | {r['haystack']:.2f} | {r['key']:.2f} | {r['value']:.2f} | "
              f"{r['value_over_haystack']:.2f} | {heads} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": args.checkpoint, "length":
                                               args.length, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
