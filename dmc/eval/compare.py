"""``dmc eval compare``: KV-cache compression methods side by side, as in Table 1 of the DMC paper
(Nawrot et al., 2024: vanilla vs DMC vs GQA vs H2O/TOVA at 2x and 4x).

Every method runs on the same held-out sequences through :class:`dmc.inference.Engine` with its
real cache: the vanilla model; DMC checkpoints (``--dmc``); GQA checkpoints (``--gqa``, made by
``dmc baseline gqa`` and up-trained); and training-free KV policies (``--policies``) applied to
the vanilla model at each ``--crs``. Two numbers per method: perplexity with the first
``--prefill-fraction`` of each sequence prefilled and the rest decoded token by token (so a
policy compresses during decoding as well), and needle-in-a-haystack accuracy
(:mod:`dmc.data.needle`: the prompt prefilled, the answer decoded). The measured CR is always
relative to the vanilla cache: KV slots the vanilla model keeps / slots the method keeps (GQA's
fewer KV heads included).

Output: a table (rows = methods, columns = nominal CR, cells = ``ppl / needle accuracy
(measured CR)``), ``compare.json`` and ``compare.png`` (quality vs measured CR) in ``--output``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from dmc.inference.cli_args import add_cache_arguments

DEFAULT_POLICIES = "h2o,tova,snapkv,streamingllm"


@dataclass
class Method:
    """One row entry: ``kind`` is vanilla, dmc, gqa or policy; ``path`` the checkpoint
    (``None`` for policies, which run on the vanilla model); ``policy`` the policy name."""

    kind: str
    label: str
    path: str | None = None
    policy: str | None = None
    cr: float | None = None  # requested CR of a policy


# ----------------------------------------------------------------------------- arguments
def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--vanilla", required=True, metavar="PATH",
                        help="the uncompressed model (checkpoint folder, run folder or .pt); "
                        "the policies run on it and measured CRs are relative to its cache")
    parser.add_argument("--dmc", nargs="+", default=[], metavar="PATH",
                        help="DMC checkpoints (e.g. runs/dmc2/checkpoints/solidify)")
    parser.add_argument("--gqa", nargs="+", default=[], metavar="PATH",
                        help="GQA checkpoints (dmc baseline gqa, then up-trained)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated KV policies run on the vanilla model at every "
                        "--crs, or 'none' (default: %(default)s)")
    parser.add_argument("--crs", default="2,4",
                        help="comma-separated compression ratios for the policies "
                        "(default: %(default)s)")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="held-out tokens (as for `dmc eval ppl`: a `dmc data prepare` "
                        "folder, an indexed dataset prefix or a .pt/.npy file)")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="tokens per sequence, also per needle example (default: %(default)s)")
    parser.add_argument("--num-sequences", type=int, default=8,
                        help="perplexity sequences (default: %(default)s)")
    parser.add_argument("--prefill-fraction", type=float, default=0.5,
                        help="share of each sequence prefilled before token-by-token decoding "
                        "(0 < f <= 1; 1 = all prefilled; default: %(default)s)")
    parser.add_argument("--num-needles", type=int, default=10,
                        help="needle-in-a-haystack examples, 0 = none (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="needle seed (default: %(default)s)")
    add_cache_arguments(parser, dtype=False)
    parser.add_argument("--output", default="runs/compare", metavar="DIR",
                        help="where compare.json and compare.png go (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return parser


def _parse_crs(text: str) -> list[float]:
    try:
        crs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--crs: expected comma-separated numbers >= 1, got {text!r}") from None
    if not crs or any(cr < 1 for cr in crs):
        raise ValueError(f"--crs: expected comma-separated numbers >= 1, got {text!r}")
    return crs


def _parse_policies(text: str) -> list[str]:
    """Policy names, checked against ``dmc.policies.POLICY_NAMES``; ``[]`` for 'none' and when
    dmc.policies is not installed (with a message)."""
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    if names in ([], ["none"]):
        return []
    try:
        from dmc.policies import POLICY_NAMES
    except ImportError as err:
        print(f"dmc eval compare: KV policies skipped (dmc.policies is not available: {err})")
        return []
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; accepted: "
                         f"{', '.join(POLICY_NAMES)} (comma-separated) or none")
    return names


def methods_from_args(args: argparse.Namespace) -> list[Method]:
    methods = [Method("vanilla", "vanilla", args.vanilla)]
    methods += [Method("dmc", "DMC", p) for p in args.dmc]
    methods += [Method("gqa", "GQA", p) for p in args.gqa]
    crs = _parse_crs(args.crs)
    methods += [Method("policy", name.upper(), policy=name, cr=cr)
                for name in _parse_policies(args.policies) for cr in crs]
    return methods


def prefill_tokens(seq_len: int, fraction: float) -> int | None:
    """Tokens prefilled before decoding (None = all)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--prefill-fraction: expected 0 < f <= 1, got {fraction}")
    tokens = max(1, round(fraction * seq_len))
    return None if tokens >= seq_len else tokens


# ----------------------------------------------------------------------------- running
def _nominal_cr(method: Method, loaded, vanilla_kv: int, measured: float) -> float:
    """The column a result goes to: the requested CR (policies), the KV-head ratio (GQA), the
    checkpoint's target CR (DMC; the measured one rounded to 0.5 when it records none)."""
    if method.kind == "policy":
        return method.cr
    if method.kind == "gqa":
        return vanilla_kv / loaded.model_config["num_query_groups"]
    if method.kind == "dmc":
        target = loaded.state.get("target_cr")
        return float(target) if target else round(measured * 2) / 2
    return 1.0


def run_methods(methods: list[Method], sequences, needles, *, prefill: int | None,
                chunk_size: int = 512, page_size: int = 16, log=print) -> list[dict]:
    """Evaluate every method; returns one result dict per method (see :func:`run_compare`)."""
    from dmc.eval.needle import evaluate_needle
    from dmc.eval.perplexity import evaluate_perplexity
    from dmc.inference.engine import Engine
    from dmc.inference.loading import load_model

    longest = max(len(s) for s in list(sequences) + [n.tokens for n in needles])
    vanilla = load_model(methods[0].path)
    if vanilla.dmc_config is not None:
        raise ValueError(f"--vanilla {methods[0].path} is a DMC model; pass it with --dmc")
    vanilla_kv = vanilla.model_config.get("num_query_groups") or \
        vanilla.model_config["num_attention_heads"]
    results = []
    for method in methods:
        loaded = vanilla if method.kind in ("vanilla", "policy") else load_model(method.path)
        if method.kind == "dmc" and loaded.dmc_config is None:
            raise ValueError(f"--dmc {method.path} is not a DMC model (no dmc_config)")
        if method.kind == "gqa" and loaded.dmc_config is not None:
            raise ValueError(f"--gqa {method.path} is a DMC model")

        def engine():  # a fresh engine (and policy) per task: a policy serves one engine
            kwargs = dict(max_batch=1, max_seq_len=longest, chunk_size=chunk_size,
                          page_size=page_size)
            if method.kind == "policy":
                from dmc.policies import get_policy

                policy = get_policy(method.policy, compression_ratio=method.cr)
                return Engine(loaded.model, dmc=None, policy=policy, **kwargs)
            return Engine(loaded.model, dmc="auto" if method.kind == "dmc" else None, **kwargs)

        name = method.label + (f" {method.cr:g}x" if method.cr else f" {method.path}")
        log(f"== {name}")
        ppl = evaluate_perplexity(engine(), sequences, prefill_tokens=prefill)
        kv = loaded.model_config.get("num_query_groups") or \
            loaded.model_config["num_attention_heads"]
        measured = ppl["compression"]["cr"] * vanilla_kv / kv
        result = {"method": method.kind, "label": method.label, "path": method.path,
                  "policy": method.policy, "requested_cr": method.cr,
                  "nominal_cr": _nominal_cr(method, loaded, vanilla_kv, measured),
                  "measured_cr": measured, "perplexity": ppl["perplexity"], "ppl": ppl}
        if needles:
            needle = evaluate_needle(engine(), needles)
            result["needle_accuracy"] = needle["accuracy"]
            result["needle"] = needle
        results.append(result)
        log(f"   ppl {result['perplexity']:.3f}, measured CR {measured:.2f}"
            + (f", needle {result['needle_accuracy']:.0%}" if needles else ""))
    return results


# ----------------------------------------------------------------------------- reporting
def _row_labels(results: list[dict]) -> None:
    """Rows are labels; a second result with the same label and column gets ``#2``, ..."""
    seen: dict[tuple, int] = {}
    for r in results:
        key = (r["label"], round(r["nominal_cr"], 2))
        seen[key] = seen.get(key, 0) + 1
        r["row"] = r["label"] if seen[key] == 1 else f"{r['label']} #{seen[key]}"


def format_table(results: list[dict]) -> str:
    """Rows = methods, columns = nominal CR, cells ``ppl / needle accuracy (measured CR)``."""
    columns = sorted({round(r["nominal_cr"], 2) for r in results})
    rows = list(dict.fromkeys(r["row"] for r in results))
    cells = {}
    for r in results:
        text = f"{r['perplexity']:.2f}"
        if "needle_accuracy" in r:
            text += f" / {r['needle_accuracy']:.0%}"
        cells[r["row"], round(r["nominal_cr"], 2)] = text + f" ({r['measured_cr']:.2f}x)"
    width = max([len(c) for c in cells.values()] + [8]) + 2
    first = max(len(r) for r in rows) + 2
    lines = [f"{'method':<{first}}" + "".join(f"{f'CR {c:g}x':>{width}}" for c in columns)]
    for row in rows:
        lines.append(f"{row:<{first}}" + "".join(f"{cells.get((row, c), '-'):>{width}}"
                                                 for c in columns))
    has_needle = any("needle_accuracy" in r for r in results)
    lines.append("cells: perplexity" + (" / needle accuracy" if has_needle else "")
                 + " (measured CR vs the vanilla cache)")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Perplexity and needle accuracy against the measured CR, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_needle = any("needle_accuracy" in r for r in results)
    fig, axes = plt.subplots(1, 2 if has_needle else 1, figsize=(11 if has_needle else 6, 4),
                             squeeze=False)
    for label in dict.fromkeys(r["label"] for r in results):
        group = sorted((r for r in results if r["label"] == label),
                       key=lambda r: r["measured_cr"])
        xs = [r["measured_cr"] for r in group]
        axes[0, 0].plot(xs, [r["perplexity"] for r in group], marker="o", label=label)
        if has_needle:
            axes[0, 1].plot(xs, [r.get("needle_accuracy", float("nan")) for r in group],
                            marker="o", label=label)
    axes[0, 0].set(xlabel="measured CR", ylabel="perplexity", title="perplexity (lower is better)")
    if has_needle:
        axes[0, 1].set(xlabel="measured CR", ylabel="exact match", ylim=(-0.05, 1.05),
                       title="needle retrieval (higher is better)")
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_compare(args: argparse.Namespace) -> int:
    """``dmc eval compare``: writes ``compare.json`` and ``compare.png`` under ``--output`` and
    prints the table (or the JSON)."""
    from dmc.data.needle import make_needle_examples
    from dmc.eval.perplexity import load_token_sequences

    if args.seq_len < 2:
        raise ValueError(f"--seq-len: must be >= 2, got {args.seq_len}")
    if args.num_sequences < 1:
        raise ValueError(f"--num-sequences: must be >= 1, got {args.num_sequences}")
    if args.num_needles < 0:
        raise ValueError(f"--num-needles: must be >= 0, got {args.num_needles}")
    prefill = prefill_tokens(args.seq_len, args.prefill_fraction)
    methods = methods_from_args(args)
    sequences = load_token_sequences(args.data, args.seq_len, args.num_sequences)
    if not sequences:
        raise ValueError(f"--data {args.data}: fewer than --seq-len={args.seq_len} tokens")
    needles = []
    if args.num_needles:
        stream = [t for s in load_token_sequences(args.data, args.seq_len) for t in s]
        needles = make_needle_examples(stream, args.seq_len, args.num_needles, seed=args.seed,
                                       exclude=_special_ids(args.data))
    log = (lambda *_: None) if args.json else print
    results = run_methods(methods, sequences, needles, prefill=prefill,
                          chunk_size=args.chunk_size, page_size=args.page_size, log=log)
    _row_labels(results)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": {"data": str(args.data), "seq_len": args.seq_len,
                           "sequences": len(sequences), "prefill_tokens": prefill,
                           "needles": len(needles), "seed": args.seed,
                           "chunk_size": args.chunk_size, "page_size": args.page_size},
              "table": format_table(results), "results": results}
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "compare.png")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print()
        print(report["table"])
        print(f"written: {out / 'compare.json'}, {out / 'compare.png'}")
    return 0


def _special_ids(data) -> set[int]:
    """End-of-document, BOS and pad ids of a `dmc data prepare` folder (kept out of needles)."""
    if not Path(data).is_dir():
        return set()
    from dmc.data import load_meta

    meta = load_meta(data)
    return {meta[k] for k in ("eod", "bos", "pad") if meta.get(k) is not None}
