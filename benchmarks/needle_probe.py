"""Needle error analysis of one checkpoint with its full cache (a plain forward, greedy).

    python benchmarks/needle_probe.py CHECKPOINT DATA_DIR [--lengths 256,512,1024] [--needles 40]
        [--token-keys] [--attention-scale FACTOR[@LAYERS]] [--heads] [--json PATH]

Per context length, on ``--needles`` examples of :func:`dmc.data.needle.make_needle_examples`
(8-token key, 4-token value, corpus spans of DATA_DIR's held-out split, depths cycling through
0.1 ... 0.9): exact match of the value, accuracy of its first token, mean token accuracy, and exact
match split by whether the key's last token occurs elsewhere in the prompt (a model that matches
on that one token alone cannot tell such needles from the haystack). What it separates: a model
that does not find the needle (first token wrong) from one that finds it and miscopies the value.
Beside them, the copy accuracy: ``--needles`` spans of 24 tokens drawn one by one from the held-out
stream (no n-gram predicts them), after ``length - 48`` tokens of held-out text and then repeated;
top-1 accuracy on tokens 2..24 of the repeat. It bounds what a model's induction copy can give a
needle's value (a value of 4 tokens copied at accuracy ``a`` is exact about ``a^4`` of the time).
Where the first value token is missed, the miss is counted as a *wrong copy* when the prediction
is the token that follows another occurrence of the key's last token in the prompt (an induction
match on that one token, at the wrong place) or *not in the prompt* (no copy at all).
Exact match is also given per needle depth. Two diagnostics: ``--token-keys`` draws each key's
tokens one by one (no n-gram of the key recurs in the haystack more than by chance, so a miss is
not a partial match on a text span); ``--attention-scale 1.3@2,3`` multiplies the attention
logits (the softmax scale) of layers 2 and 3 (0-based; all layers without ``@``) by 1.3: what
sharper attention would find. ``--heads`` adds, per length, each head's attention weight on the
value's first token from the query that predicts it, for the needles found and missed, and how
often the first token is predicted given the largest such weight of any head: a needle missed
although a head looks at its value is a copy that does not win over the rest of the model, one
missed where no head looks is a needle not found. Prints tables; ``--json PATH`` writes the
numbers.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from dmc.data.indexed import read_indexed_dataset
from dmc.data.needle import make_needle_examples
from dmc.inference.loading import load_model


COPY_SPAN = 24
MASS_BINS = (0.0, 0.3, 0.6, 0.8, 1.01)


def copy_accuracy(model, stream: list[int], length: int, count: int, seed: int) -> float:
    """Mean top-1 accuracy on tokens 2..COPY_SPAN of the repeat (see the module docstring)."""
    rng = random.Random(seed)
    total = 0.0
    for _ in range(count):
        span = [stream[rng.randrange(len(stream))] for _ in range(COPY_SPAN)]
        start = rng.randrange(len(stream) - length)
        tokens = torch.tensor([stream[start:start + length - 2 * COPY_SPAN] + span + span])
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1])[None], None)[0]
        predicted = logits[-COPY_SPAN:-1].argmax(-1)
        total += (predicted == tokens[0, 1 - COPY_SPAN:]).float().mean().item()
    return total / count


def _first_token_miss(example, predicted: int) -> str:
    """``wrong_copy``, ``not_in_prompt`` or ``other`` (see the module docstring)."""
    prompt, last = example.prompt, example.key[-1]
    needle = range(example.needle_start, example.needle_start + example.key_len)
    follows = {prompt[i + 1] for i in range(len(prompt) - 1)
               if prompt[i] == last and i not in needle}
    if predicted in follows:
        return "wrong_copy"
    return "not_in_prompt" if predicted not in prompt else "other"


def scale_attention(model, spec: str) -> None:
    """Multiply the softmax scale of the core attention of the layers in ``spec`` (``F`` or
    ``F@I,J``; see the module docstring), in place. Raises ValueError naming the option."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    factor, _, layers = spec.partition("@")
    try:
        chosen = [int(i) for i in layers.split(",")] if layers else list(range(len(cores)))
        factor = float(factor)
    except ValueError:
        raise ValueError(f"--attention-scale: expected FACTOR or FACTOR@I,J, got {spec!r}"
                         ) from None
    if not cores or any(not 0 <= i < len(cores) for i in chosen):
        raise ValueError(f"--attention-scale: layers must be in 0..{len(cores) - 1} (the "
                         f"model's megatron core attentions), got {spec!r}")
    for i in chosen:
        cores[i].softmax_scale *= factor


def needle_attention(model, examples) -> dict:
    """Where the heads look when the model predicts a needle's first value token: per (layer,
    head), the mean attention weight of that query (the query's last key token, at
    ``prompt_len - 1``) on the value's first token (the token an induction head must copy),
    over the examples whose first value token is predicted (``hit``) and missed (``miss``);
    and, by the largest such weight of any head (bins ``MASS_BINS``), how many examples, the
    share predicted and the median probability of the value's first token. The weights are
    the softmax of the core attention's own queries and keys (after RoPE, GQA groups
    expanded, its softmax scale)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    captured: dict[int, tuple] = {}

    def capture(layer):
        def hook(module, args):
            captured[layer] = (args[0].detach(), args[1].detach(), module.softmax_scale)
        return hook

    handles = [core.register_forward_pre_hook(capture(i)) for i, core in enumerate(cores)]
    mass = {"hit": [], "miss": []}
    found = []  # (largest weight on the value, hit, p(value's first token))
    try:
        for example in examples:
            tokens = torch.tensor([list(example.tokens)])
            with torch.no_grad():
                logits = model(tokens, torch.arange(tokens.shape[1])[None], None)[0]
            at, value = example.prompt_len - 1, example.needle_start + example.key_len
            weights = torch.stack([attention_row(*captured[i], at)[:, value]
                                   for i in range(len(cores))])  # [layers, heads]
            probs = torch.softmax(logits[at].double(), dim=-1)
            hit = int(probs.argmax()) == example.answer[0]
            mass["hit" if hit else "miss"].append(weights)
            found.append((float(weights.max()), hit, float(probs[example.answer[0]])))
    finally:
        for handle in handles:
            handle.remove()
    bins = []
    for low, high in zip(MASS_BINS, MASS_BINS[1:]):
        chosen = [(hit, p) for top, hit, p in found if low <= top < high]
        if chosen:
            bins.append({"from": low, "to": min(high, 1.0), "examples": len(chosen),
                         "hit": sum(h for h, _ in chosen) / len(chosen),
                         "median_p": statistics.median(p for _, p in chosen)})
    return {kind: {"examples": len(rows),
                   "mass": torch.stack(rows).mean(0).tolist() if rows else None}
            for kind, rows in mass.items()} | {"by_largest_mass": bins}


def attention_row(query: torch.Tensor, key: torch.Tensor, scale: float | None,
                  at: int) -> torch.Tensor:
    """Attention weights ``[heads, at + 1]`` of the query at position ``at`` over the keys
    ``0..at``, from a megatron core attention's inputs (query ``[seq, 1, heads, dim]``, key
    ``[seq, 1, groups, dim]``; query head ``h`` reads group ``h // (heads / groups)``), in
    float64."""
    q = query[at, 0].double()
    k = key[:at + 1, 0].double().repeat_interleave(q.shape[0] // key.shape[2], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(torch.einsum("hd,shd->hs", q, k) * scale, dim=-1)


def probe(model, stream: list[int], length: int, count: int, seed: int,
          token_keys: bool = False) -> dict:
    """The accuracies above for ``count`` needles in ``length``-token prompts."""
    totals = {"exact": 0, "first": 0, "token": 0.0, "unique": 0, "exact_unique": 0,
              "wrong_copy": 0, "not_in_prompt": 0, "other": 0}
    by_depth: dict[float, list[int]] = {}  # depth -> [needles, exact]
    for example in make_needle_examples(stream, length, count, seed=seed,
                                        token_keys=token_keys):
        tokens = torch.tensor([list(example.tokens)])
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1])[None], None)[0]
        answer = torch.tensor(example.answer)
        predicted = logits[example.prompt_len - 1:-1].argmax(-1)
        correct = predicted == answer
        unique = example.prompt.count(example.key[-1]) == 2  # the needle's key and the query's
        totals["exact"] += bool(correct.all())
        totals["first"] += bool(correct[0])
        if not correct[0]:
            totals[_first_token_miss(example, int(predicted[0]))] += 1
        totals["token"] += correct.float().mean().item()
        totals["unique"] += unique
        totals["exact_unique"] += bool(correct.all()) and unique
        cell = by_depth.setdefault(example.depth, [0, 0])
        cell[0], cell[1] = cell[0] + 1, cell[1] + bool(correct.all())
    shared = count - totals["unique"]
    return {"length": length, "needles": count, "exact": totals["exact"] / count,
            "first_token": totals["first"] / count, "token": totals["token"] / count,
            "unique_last_key_token": totals["unique"],
            "exact_if_unique": totals["exact_unique"] / max(totals["unique"], 1),
            "exact_if_shared": (totals["exact"] - totals["exact_unique"]) / max(shared, 1),
            "first_token_misses": count - totals["first"],
            "misses_wrong_copy": totals["wrong_copy"],
            "misses_not_in_prompt": totals["not_in_prompt"],
            "exact_by_depth": {str(d): hit / n for d, (n, hit) in sorted(by_depth.items())},
            "copy": copy_accuracy(model, stream, length, count, seed)}


def print_heads(length: int, heads: dict) -> None:
    """Markdown tables of :func:`needle_attention`'s result."""
    hit, miss = heads["hit"], heads["miss"]
    print(f"\n{length} tokens: attention weight on the value's first token, predicted "
          f"({hit['examples']}) / missed ({miss['examples']})")
    layers = hit["mass"] or miss["mass"]
    print("| layer | " + " | ".join(f"head {h}" for h in range(len(layers[0]))) + " |")
    print("|---" * (len(layers[0]) + 1) + "|")
    for i in range(len(layers)):
        cells = [" / ".join("-" if part["mass"] is None else f"{part['mass'][i][h]:.2f}"
                            for part in (hit, miss)) for h in range(len(layers[0]))]
        print(f"| {i} | " + " | ".join(cells) + " |")
    print("| largest weight of a head | needles | predicted | median p(first value token) |")
    print("|---|---|---|---|")
    for b in heads["by_largest_mass"]:
        print(f"| [{b['from']:.1f}, {b['to']:.1f}) | {b['examples']} | {b['hit']:.2f} | "
              f"{b['median_p']:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data", help="a `dmc data prepare` folder (its valid split is used)")
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--needles", type=int, default=40)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--token-keys", action="store_true")
    parser.add_argument("--attention-scale", metavar="FACTOR[@LAYERS]")
    parser.add_argument("--heads", action="store_true",
                        help="also the attention of each head on the needle's value")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        print(f"--lengths: expected comma-separated integers, got {args.lengths!r}",
              file=sys.stderr)
        return 2
    if min(lengths) <= 2 * COPY_SPAN:
        print(f"--lengths: every length must be > {2 * COPY_SPAN}, got {args.lengths!r}",
              file=sys.stderr)
        return 2
    prefix = Path(args.data) / "valid_text_document"
    if not prefix.with_suffix(".idx").is_file():
        print(f"data: {args.data} holds no valid split (valid_text_document.idx); give a "
              f"`dmc data prepare` output folder", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    stream = [t for doc in read_indexed_dataset(str(prefix)) for t in doc]
    model = load_model(args.checkpoint).model.eval()
    if args.attention_scale:
        try:
            scale_attention(model, args.attention_scale)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
    rows = [probe(model, stream, length, args.needles, args.seed, args.token_keys)
            for length in lengths]
    print("| length | exact | first token | token | exact (last key token unique / shared) "
          "| first-token misses: wrong copy / not in prompt | copy | exact by depth |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['exact']:.2f} | {r['first_token']:.2f} | {r['token']:.2f} | "
              f"{r['exact_if_unique']:.2f} / {r['exact_if_shared']:.2f} "
              f"({r['unique_last_key_token']} unique) | {r['first_token_misses']}: "
              f"{r['misses_wrong_copy']} / {r['misses_not_in_prompt']} | {r['copy']:.2f} | "
              + " / ".join(f"{v:.2f}" for v in r["exact_by_depth"].values()) + " |")
    for r in rows if args.heads else []:
        r["heads"] = needle_attention(model, make_needle_examples(
            stream, r["length"], args.needles, seed=args.seed, token_keys=args.token_keys))
        print_heads(r["length"], r["heads"])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"checkpoint": args.checkpoint, "token_keys": args.token_keys,
             "attention_scale": args.attention_scale, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
