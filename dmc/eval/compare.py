"""``dmc eval compare``: KV-cache compression methods side by side at equal memory, as in Table 1
of the DMC paper (Nawrot et al., 2024: vanilla vs DMC vs GQA vs H2O/TOVA at 2x and 4x).

Every method runs on the same held-out data through :class:`dmc.inference.Engine` with its real
cache: the **control** (``--control``, the uncompressed model every other row is measured against:
ideally the base up-trained with the same steps, data and LR as the DMC and GQA runs, so that the
comparison is between caches and not between training budgets), the pretrained **base**
(``--base``, optional), **DMC** checkpoints (``--dmc``), **GQA** checkpoints (``--gqa``: ``dmc
baseline gqa`` then up-trained) and training-free **KV policies** (``--policies``) applied to the
control at each ``--crs``.

Per method (:func:`evaluate_method`):

* perplexity of the decoded continuation only: the first ``--prefill-fraction`` of each sequence
  is prefilled (a policy compresses it as before generating), the rest is teacher-forced token by
  token through the decode path and only those predictions are scored. A policy compresses on
  its schedule (``NAME@SCHEDULE``, each paper's by default, recorded as ``schedule``): under
  ``prefill`` the decoded tokens are added uncompressed, so its slots and memory CR (measured at
  the end) are below the requested CR of its row;
* KL divergence ``KL(control || method)`` of the next-token distributions and greedy top-1
  agreement with the control, on the same decoded tokens;
* needle-in-a-haystack exact match (:mod:`dmc.data.needle`) at several context lengths x 5
  depths, with a 95% Wilson interval;
* two compression ratios against the control's cache on the same sequences: **slots** (KV slots
  the control keeps / slots the method keeps, GQA's fewer KV heads included) and **memory** (bytes
  the control's cache holds / bytes the method's holds: pages, block tables and lengths, DMC's
  merge state, a policy's per-slot scores and positions; :meth:`Engine.sequence_bytes`).

Output: a markdown table (one row per method and CR), ``compare.json`` and ``compare.png`` (quality
against the memory CR) in ``--output``.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from dmc.eval.compare_report import (  # noqa: F401 (the report's API, also imported from here)
    _ci,
    _row_labels,
    format_needle_table,
    format_table,
    plot,
    summary_line,
    write_report,
)
from dmc.inference.cli_args import add_cache_arguments

DEFAULT_POLICIES = "h2o,tova,snapkv,streamingllm"
DEFAULT_DEPTHS = "0.1,0.3,0.5,0.7,0.9"
KINDS = ("control", "base", "dmc", "gqa", "policy")


@dataclass
class Method:
    """One row: ``kind`` is one of :data:`KINDS`; ``path`` the checkpoint (``None`` for policies,
    which run on the control); ``policy`` the policy name and ``cr`` its requested CR."""

    kind: str
    label: str
    path: str | None = None
    policy: str | None = None
    cr: float | None = None


@dataclass
class EvalData:
    """What every method is evaluated on: perplexity ``sequences`` (token lists), the number of
    ``prefill`` tokens of each, and needle ``needles`` (:class:`~dmc.data.needle.NeedleExample`)."""

    sequences: list
    prefill: int
    needles: list


# ----------------------------------------------------------------------------- arguments
def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--control", "--vanilla", dest="control", required=True, metavar="PATH",
                        help="the uncompressed model every row is measured against (KL, top-1, "
                        "compression); the policies run on it. Best: the base up-trained with "
                        "the same steps, data and LR as the DMC and GQA runs (a retrofit with "
                        "dmc.enabled=false)")
    parser.add_argument("--base", metavar="PATH", help="the pretrained base model (a row)")
    parser.add_argument("--dmc", nargs="+", action="extend", default=[], metavar="PATH",
                        help="DMC or DMS checkpoints, labelled by their method (e.g. "
                        "runs/dmc2/checkpoints/solidify); repeatable")
    parser.add_argument("--gqa", nargs="+", action="extend", default=[], metavar="PATH",
                        help="GQA checkpoints (dmc baseline gqa, then up-trained); repeatable")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated KV policies run on the control at every --crs, "
                        "each NAME (its paper's schedule) or NAME@SCHEDULE (prefill, prefill/N: "
                        "re-compress every N decode steps, or streaming), or 'none' (default: "
                        "%(default)s)")
    parser.add_argument("--crs", default="2,4",
                        help="comma-separated compression ratios for the policies "
                        "(default: %(default)s)")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="held-out tokens (as for `dmc eval ppl`: a `dmc data prepare` "
                        "folder, an indexed dataset prefix or a .pt/.npy file)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="tokens per perplexity sequence (default: %(default)s)")
    parser.add_argument("--num-sequences", type=int, default=16,
                        help="perplexity sequences (default: %(default)s)")
    parser.add_argument("--prefill-fraction", type=float, default=0.5,
                        help="share of each sequence prefilled before token-by-token decoding; "
                        "only the decoded predictions are scored (0 < f < 1; default: "
                        "%(default)s)")
    parser.add_argument("--needle-lengths", default=None,
                        help="comma-separated needle context lengths in tokens, or 'none' "
                        "(default: seq-len / 4, / 2 and seq-len)")
    parser.add_argument("--needle-depths", default=DEFAULT_DEPTHS,
                        help="comma-separated needle depths in [0, 1] (default: %(default)s)")
    parser.add_argument("--needles-per-cell", type=int, default=14,
                        help="needle examples per (length, depth); 14 x 3 x 5 = 210 examples "
                        "keep the 95%% interval within +-7 points (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences scored together (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="needle seed (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes scoring the rows after the control, sharing the threads "
                        "(2 on a 2-core CPU: ~1.5x the rows per minute, same numbers; default: "
                        "%(default)s)")
    add_cache_arguments(parser, dtype=False)
    parser.add_argument("--output", default="runs/compare", metavar="DIR",
                        help="where compare.json, compare.md and compare.png go "
                        "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return parser


def parse_numbers(text: str, flag: str, low: float, high: float = math.inf,
                  kind=float) -> list:
    """Comma-separated distinct finite numbers in ``[low, high]``; a ValueError naming ``flag``
    otherwise (a repeated value would score the same examples or rows twice)."""
    accepted = f"comma-separated distinct numbers in [{low:g}, {high:g}" + (
        ")" if high == math.inf else "]")
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected {accepted}, got {text!r}") from None
    if (not values or any(not (low <= v <= high and math.isfinite(v)) for v in values)
            or len(set(values)) < len(values)):
        raise ValueError(f"{flag}: expected {accepted}, got {text!r}")
    return values


def parse_policies(text: str) -> list[str]:
    """Policy specs (``NAME`` or ``NAME@SCHEDULE``, :func:`dmc.policies.parse_policy_spec`),
    checked; ``[]`` for 'none'."""
    specs = [x.strip().lower() for x in text.split(",") if x.strip()]
    if specs in ([], ["none"]):
        return []
    from dmc.policies import POLICY_NAMES, SPEC_SYNTAX, parse_policy_spec

    unknown = [s for s in specs if s.partition("@")[0] not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; accepted: "
                         f"{', '.join(POLICY_NAMES)} (comma-separated) or none")
    for spec in specs:
        try:
            parse_policy_spec(spec)
        except ValueError as err:
            raise ValueError(f"--policies: {spec}: {err}; a policy is spelled {SPEC_SYNTAX}"
                             ) from None
    return specs


def compressed_label(path) -> str:
    """"DMS" for a ``--dmc`` checkpoint trained with ``dmc.method=dms``, "DMC delay D" for one
    with ``dmc.merge_delay=D``, else "DMC" (a vanilla one is refused when it is loaded,
    :mod:`dmc.eval.workers`)."""
    from dmc.inference.loading import saved_dmc_config

    dmc = saved_dmc_config(path)
    if dmc is not None and dmc.method == "dms":
        return "DMS"
    return f"DMC delay {dmc.merge_delay}" if dmc is not None and dmc.merge_delay else "DMC"


def methods_from_args(args: argparse.Namespace) -> list[Method]:
    methods = [Method("control", "control", args.control)]
    if args.base:
        methods.append(Method("base", "base", args.base))
    methods += [Method("dmc", compressed_label(p), p) for p in args.dmc]
    methods += [Method("gqa", "GQA", p) for p in args.gqa]
    crs = parse_numbers(args.crs, "--crs", 1.0)
    methods += [Method("policy", name.upper(), policy=name, cr=cr)
                for name in parse_policies(args.policies) for cr in crs]
    return methods


def prefill_tokens(seq_len: int, fraction: float) -> int:
    """Tokens prefilled before decoding: at least one, and at least one decoded prediction."""
    if not 0 < fraction < 1:
        raise ValueError(f"--prefill-fraction: expected 0 < f < 1, got {fraction}")
    return min(max(1, round(fraction * seq_len)), seq_len - 2)


# ----------------------------------------------------------------------------- running
def nominal_cr(method: Method, loaded, control_kv: int, measured: float) -> float:
    """The CR a result is reported at: the requested CR (policies that evict), the KV-head ratio
    (GQA), the checkpoint's target CR (DMC; the measured one rounded to 0.5 when it records
    none), 1 (control, base, and a policy that drops no token, OmniKV: its requested CR is the
    share of tokens its sparse layers attend to; what its host offload saves on the device shows
    in the memory CR column, its dense layers keeping every slot)."""
    if method.kind == "policy":
        from dmc.policies import POLICIES, parse_policy_spec

        return method.cr if POLICIES[parse_policy_spec(method.policy)[0]].evicts else 1.0
    if method.kind == "gqa":
        return control_kv / loaded.model_config.kv_heads
    if method.kind == "dmc":
        target = loaded.state.get("target_cr")
        return float(target) if target else round(measured * 2) / 2
    return 1.0


def make_engine(method: Method, loaded, data: EvalData, *, batch_size: int,
                chunk_size: int = 512, page_size: int = 16):
    """A fresh engine (and policy: a policy serves one engine) for ``method``'s model."""
    from dmc.inference.engine import Engine

    longest = max(len(s) for s in list(data.sequences) + [n.tokens for n in data.needles])
    kwargs = dict(max_batch=batch_size, max_seq_len=longest, chunk_size=chunk_size,
                  page_size=page_size)
    if method.kind == "policy":
        from dmc.policies import policy_from_spec

        policy = policy_from_spec(method.policy, compression_ratio=method.cr)
        return Engine(loaded.model, dmc=None, policy=policy, **kwargs)
    return Engine(loaded.model, dmc="auto" if method.kind == "dmc" else None, **kwargs)


def schedule_of(method: Method) -> str | None:
    """The compression schedule a policy row runs under (its spec's, else its paper's), e.g.
    ``"prefill"``, ``"prefill/1"``, ``"streaming"``; None for other rows."""
    if method.kind != "policy":
        return None
    from dmc.policies import policy_from_spec

    return policy_from_spec(method.policy, compression_ratio=method.cr).plan.text


def evaluate_method(method: Method, loaded, data: EvalData, reference: dict | None, *,
                    batch_size: int = 8, chunk_size: int = 512, page_size: int = 16) -> dict:
    """Scores of one method (see the module docstring). ``reference``: the control's result
    (its ``logprobs`` kept) or None when ``method`` is the control. Returns a JSON-able dict
    (the control's carries ``logprobs`` too, removed by :func:`run_methods`)."""
    from dmc.eval.needle import evaluate_needle
    from dmc.eval.perplexity import evaluate_perplexity

    dtype = loaded.dtype  # the cache's
    if reference is not None and dtype != reference["dtype"]:
        raise ValueError(f"--{method.kind} {method.path}: its weights, and so its cache, are "
                         f"{dtype}, the control's {reference['dtype']}; the memory CR would count "
                         f"the precision as compression: give it in the control's precision")

    def engine():
        return make_engine(method, loaded, data, batch_size=batch_size, chunk_size=chunk_size,
                           page_size=page_size)

    ppl = evaluate_perplexity(engine(), data.sequences, prefill_tokens=data.prefill,
                              reference=None if reference is None else reference["logprobs"],
                              keep_logprobs=reference is None)
    control_kv = (reference or {"model_config": loaded.model_config})["model_config"].kv_heads
    slots_cr = ppl["compression"]["cr"] * control_kv / loaded.model_config.kv_heads
    control_bytes = (reference or ppl)["cache_bytes"]["total"]
    result = {"method": method.kind, "label": method.label, "path": method.path,
              "policy": method.policy, "schedule": schedule_of(method),
              "requested_cr": method.cr,
              "nominal_cr": nominal_cr(method, loaded, control_kv, slots_cr),
              "slots_cr": slots_cr, "memory_cr": control_bytes / ppl["cache_bytes"]["total"],
              "model_config": loaded.model_config.to_dict(),
              "perplexity": ppl["perplexity"], "perplexity_ci": ppl["perplexity_ci"],
              "kl": ppl.get("kl", 0.0), "kl_ci": ppl.get("kl_ci", [0.0, 0.0]),
              "top1_agreement": ppl.get("top1_agreement", 1.0),
              "top1_ci": ppl.get("top1_ci", [1.0, 1.0]), "ppl": ppl}
    if reference is None:
        result["logprobs"] = ppl.pop("logprobs")
        result["cache_bytes"] = ppl["cache_bytes"]
        result["dtype"] = dtype
    if data.needles:
        needle = evaluate_needle(engine(), data.needles)
        result.update(needle_accuracy=needle["accuracy"], needle_ci=needle["accuracy_ci"],
                      needle=needle)
    return result


def run_methods(methods: list[Method], data: EvalData, *, batch_size: int = 8,
                chunk_size: int = 512, page_size: int = 16, workers: int = 1,
                log=print) -> list[dict]:
    """Evaluate every method (the control first, then the others against it, in ``workers``
    processes when more than one: :mod:`dmc.eval.workers`); returns one result dict per
    method, in order."""
    from dmc.eval.workers import evaluate_in_workers, load_for
    from dmc.inference.loading import load_model

    if methods[0].kind != "control":
        raise ValueError("run_methods: the first method must be the control")
    if workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {workers}")
    control = load_model(methods[0].path)
    if control.dmc_config is not None:
        raise ValueError(f"--control {methods[0].path} is a DMC model; pass it with --dmc")
    settings = dict(batch_size=batch_size, chunk_size=chunk_size, page_size=page_size)
    results, reference = [], None
    for i, method in enumerate(methods):
        if reference is not None and workers > 1 and len(methods) - i > 1:
            return results + evaluate_in_workers(methods[i:], data, reference,
                                                 methods[0].path, settings, workers, log=log)
        loaded = load_for(method, methods[0].path, control)
        log(f"== {method.label}" + (f" {method.cr:g}x" if method.cr else f" {method.path}"))
        result = evaluate_method(method, loaded, data, reference, **settings)
        if reference is None:
            reference = {"logprobs": result.pop("logprobs"),
                         "model_config": loaded.model_config,
                         "cache_bytes": result["cache_bytes"], "dtype": result.pop("dtype")}
        results.append(result)
        log("   " + summary_line(result))
    return results


def load_eval_data(data: str, seq_len: int, num_sequences: int, prefill_fraction: float,
                   needle_lengths: list[int], depths: list[float], per_cell: int,
                   seed: int = 0) -> EvalData:
    """Perplexity sequences and needle examples from a held-out token source (needles of each
    length are drawn from the start of the stream with seed ``seed + length``)."""
    from dmc.data.needle import make_needle_examples
    from dmc.eval.perplexity import load_token_sequences

    sequences = load_token_sequences(data, seq_len, num_sequences)
    lengths = sorted({len(s) for s in sequences} - {seq_len})
    if lengths:  # a 2-D array's rows come whole; the prefill is a fraction of --seq-len
        raise ValueError(f"--data {data}: its rows hold {lengths[0]} tokens, --seq-len="
                         f"{seq_len}; pass --seq-len {lengths[0]} (a 2-D array is scored whole)")
    if len(sequences) < num_sequences:
        raise ValueError(f"--data {data}: only {len(sequences)} sequences of --seq-len={seq_len} "
                         f"tokens, --num-sequences={num_sequences} asked")
    needles = []
    if needle_lengths:
        stream = [t for s in load_token_sequences(data, max(needle_lengths)) for t in s]
        for length in needle_lengths:
            try:
                needles += make_needle_examples(stream, length, per_cell * len(depths),
                                                depths=depths, seed=seed + length,
                                                exclude=special_ids(data))
            except ValueError as err:  # name the flags that size the needles
                raise ValueError(f"--needle-lengths {length} / --needles-per-cell {per_cell} "
                                 f"over --data {data}: {err}") from None
    return EvalData(sequences, prefill_tokens(seq_len, prefill_fraction), needles)


def run_compare(args: argparse.Namespace) -> int:
    """``dmc eval compare``: writes ``compare.json``, ``compare.md`` and ``compare.png`` under
    ``--output`` and prints the table (or the JSON)."""
    for flag, value, low in (("--seq-len", args.seq_len, 3), ("--num-sequences",
                             args.num_sequences, 1), ("--needles-per-cell",
                             args.needles_per_cell, 1), ("--batch-size", args.batch_size, 1),
                             ("--workers", args.workers, 1)):
        if value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")
    methods = methods_from_args(args)
    lengths_text = args.needle_lengths or ",".join(
        str(n) for n in sorted({max(32, args.seq_len // d) for d in (4, 2, 1)}))
    lengths = [] if lengths_text.strip().lower() == "none" else parse_numbers(
        lengths_text, "--needle-lengths", 32, kind=int)
    depths = parse_numbers(args.needle_depths, "--needle-depths", 0.0, 1.0)
    data = load_eval_data(args.data, args.seq_len, args.num_sequences, args.prefill_fraction,
                          lengths, depths, args.needles_per_cell, args.seed)
    log = (lambda *_: None) if args.json else print
    results = run_methods(methods, data, batch_size=args.batch_size, chunk_size=args.chunk_size,
                          page_size=args.page_size, workers=args.workers, log=log)
    report = write_report(results, Path(args.output), {
        "data": str(args.data), "seq_len": args.seq_len, "sequences": len(data.sequences),
        "prefill_tokens": data.prefill, "needle_lengths": lengths, "needle_depths": depths,
        "needles": len(data.needles), "seed": args.seed, "chunk_size": args.chunk_size,
        "page_size": args.page_size})
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print()
        print(report["table"])
        print()
        print(report["needle_table"])
        print(f"written: {Path(args.output) / 'compare.json'}, compare.md, compare.png")
    return 0


def special_ids(data) -> set[int]:
    """End-of-document, BOS and pad ids of a `dmc data prepare` folder (kept out of needles)."""
    if not Path(data).is_dir():
        return set()
    from dmc.data import load_meta

    meta = load_meta(data)
    return {meta[k] for k in ("eod", "bos", "pad") if meta.get(k) is not None}
