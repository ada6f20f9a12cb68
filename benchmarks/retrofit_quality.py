"""A small-scale Table 1 of the DMC paper: does a retrofitted model keep its quality at equal
memory? Driven by a YAML file (``configs/experiments/retrofit_quality.yaml``), on one machine:

1. data: ``dmc data prepare`` of Shakespeare mixed with in-context retrieval documents;
2. base: a Llama-style model pretrained on it in stages, so that it can retrieve from its context
   (cached by the hash of the data, model and base settings under ``$DMC_CACHE`` or
   ``~/.cache/dmc``, or given with ``--base``: never retrained silently, a missing one announced);
3. the **control** (the base up-trained with vanilla attention), **DMC** at every ``dmc_crs``
   and **GQA** at every ``gqa_factors`` (KV heads mean-pooled, then up-trained): all with the
   SAME steps, data (``retrofit.data``), data order and LR, so the table compares caches;
4. every method through the real engine (:mod:`dmc.eval.compare`) on the main data's held-out
   split: the control, the base, DMC, GQA and every KV policy on the control at every
   ``policy_crs``: decoded-token perplexity, KL and top-1 agreement against the control, needle
   accuracy at several lengths and depths with 95% intervals, slots CR and memory CR;
5. the DMC run with the largest CR, evaluated at its intermediate checkpoints (the paper's Fig. 4).

Writes ``OUTPUT/NAME/`` (``NAME-quick`` with ``--quick``): ``results.json``, ``table.md``,
``compare/compare.png`` (quality against memory CR), ``dmc_checkpoints.png``. Training runs live
in ``OUTPUT/runs/<run>-<hash>`` (the hash covers the settings, the data settings and the content
of the starting checkpoint, never a path) and are reused or resumed by any experiment with the
same settings. Several ``--config`` files merge left to right (an ablation file over the main).

    python benchmarks/retrofit_quality.py --config configs/experiments/retrofit_quality.yaml
    dmc bench retrofit_quality --quick"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
CACHE_VERSION = 1  # bump when the data or base recipe changes meaning
SECTIONS = {
    "output": str, "data": dict, "model": str, "base": dict, "retrofit": dict, "dmc_crs": list,
    "gqa_factors": list, "policies": list, "policy_crs": list, "intermediate_crs": list,
    "eval": dict, "quick": dict,
}
OPTIONAL = {"variants": [],  # extra DMC runs: [{name, cr, overrides, label?}] (ablations)
            "name": "table1"}  # results go to OUTPUT/NAME (OUTPUT/NAME-quick with --quick)
VARIANT_KEYS = {"name", "cr", "overrides", "label"}  # label (default: name) groups a plot line
DATA_KEYS = {"vocab_size", "retrieval_fraction", "retrieval_doc_tokens", "retrieval_kinds",
             "valid_fraction", "seed"}
STAGE_KEYS = {"data", "overrides"}
# what a base stage may change in its data: not the seed, vocab_size or valid_fraction (they
# choose the tokenizer and the held-out split); retrieval_loss (default all) is a stage's only
STAGE_DATA_KEYS = {"retrieval_fraction", "retrieval_doc_tokens", "retrieval_kinds",
                   "retrieval_loss"}
EVAL_KEYS = {"seq_len", "num_sequences", "prefill_fraction", "needle_lengths", "needle_depths",
             "needles_per_cell", "batch_size", "workers", "seed"}
QUICK_KEYS = {"data", "model_overrides", "base", "retrofit", "intermediate_crs", "eval"}


# ----------------------------------------------------------------------------- configuration
def load_experiment(paths: list[Path], quick: bool) -> dict:
    """The experiment YAML files merged left to right (mappings key by key), checked (a
    ValueError names the key and what it accepts); with ``quick`` the ``quick`` section is
    merged over the rest."""
    exp: dict = {}
    for index, path in enumerate(map(Path, paths)):
        if not path.is_file():
            raise ValueError(f"--config {path}: no such file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: expected a mapping of {', '.join(SECTIONS)}")
        if quick and index and "retrofit" in loaded:
            raise ValueError(f"--quick: --config {path} sets retrofit (a budget of its own), "
                             f"which the quick budget would replace; run it without --quick")
        for key, value in loaded.items():
            both_maps = isinstance(value, dict) and isinstance(exp.get(key), dict)
            exp[key] = {**exp[key], **value} if both_maps else value
    for key, default in OPTIONAL.items():
        exp.setdefault(key, default)
    _check_keys(exp, set(SECTIONS) | set(OPTIONAL), "the top level")
    for variant in exp["variants"]:
        if not isinstance(variant, dict):
            raise ValueError(f"variants: expected mappings of {', '.join(sorted(VARIANT_KEYS))}")
        _check_keys({"label": variant.get("name"), **variant}, VARIANT_KEYS,
                    f"variant {variant.get('name', '?')}")
        if not isinstance(variant["cr"], (int, float)) or variant["cr"] < 1:
            raise ValueError(f"variant {variant['name']}: cr must be a number >= 1, "
                             f"got {variant['cr']!r}")
    for key, kind in SECTIONS.items():
        if not isinstance(exp[key], kind):
            raise ValueError(f"{key}: expected a {kind.__name__}, got {exp[key]!r}")
    _check_keys(exp["data"], DATA_KEYS, "data")
    _check_keys(exp["eval"], EVAL_KEYS, "eval")
    exp["retrofit"] = {"data": {}, **exp["retrofit"]}
    _check_keys(exp["retrofit"], {"overrides", "data"}, "retrofit")
    _check_stage_data(exp["retrofit"]["data"], "retrofit.data")
    _check_keys(exp["base"], {"stages"}, "base")
    if not isinstance(exp["base"]["stages"], list) or not exp["base"]["stages"]:
        raise ValueError("base.stages: expected a non-empty list of {data, overrides}")
    for i, stage in enumerate(exp["base"]["stages"]):
        _check_keys(stage, STAGE_KEYS, f"base.stages[{i}]")
        _check_stage_data(stage["data"], f"base.stages[{i}].data")
    quick_section = exp.pop("quick")
    unknown = sorted(set(quick_section) - QUICK_KEYS)
    if unknown:
        raise ValueError(f"unknown key quick.{unknown[0]}; accepted: "
                         f"{', '.join(sorted(QUICK_KEYS))}")
    exp["model_overrides"] = []
    for key, value in (quick_section.items() if quick else ()):
        exp[key] = {**exp[key], **value} if isinstance(value, dict) else value
    for key in ("dmc_crs", "gqa_factors", "policy_crs", "intermediate_crs"):
        if any(not isinstance(v, (int, float)) or v < 1 for v in exp[key]):
            raise ValueError(f"{key}: expected a list of numbers >= 1, got {exp[key]!r}")
    if any(int(f) != f for f in exp["gqa_factors"]):
        raise ValueError(f"gqa_factors: expected whole numbers (KV heads divided by), got "
                         f"{exp['gqa_factors']!r}")
    runs = ["control", *(f"dmc{cr:g}" for cr in exp["dmc_crs"]),
            *(f"gqa{f:g}" for f in exp["gqa_factors"]), *(v["name"] for v in exp["variants"])]
    taken = sorted({name for name in runs if runs.count(name) > 1})
    if taken:
        raise ValueError(f"variants: the name {taken[0]!r} is given to two runs; names must "
                         f"differ from each other and from control, dmcN and gqaN")
    from dmc.eval.compare import parse_policies

    parse_policies(",".join(exp["policies"]) or "none")
    if not (ROOT / exp["model"]).is_file():
        raise ValueError(f"model: {exp['model']} is not a file under {ROOT}")
    return exp


def _check_keys(section: dict, accepted: set, where: str) -> None:
    missing, unknown = sorted(accepted - set(section)), sorted(set(section) - accepted)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]} in {where}; accepted: "
                         f"{', '.join(sorted(accepted))}")
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")


def _check_stage_data(changes: dict, where: str) -> None:
    if not isinstance(changes, dict):
        raise ValueError(f"{where}: expected a mapping of {', '.join(sorted(STAGE_DATA_KEYS))}")
    unknown = sorted(set(changes) - STAGE_DATA_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]} in {where}; accepted: "
                         f"{', '.join(sorted(STAGE_DATA_KEYS))} (the others choose the "
                         f"tokenizer and the held-out split, which every stage shares)")
    from dmc.data.prepare import RETRIEVAL_LOSSES

    if changes.get("retrieval_loss", "all") not in RETRIEVAL_LOSSES:
        raise ValueError(f"{where}.retrieval_loss: {changes['retrieval_loss']!r} not accepted; "
                         f"choose from {', '.join(RETRIEVAL_LOSSES)}")


def _hash(*parts) -> str:
    text = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def cache_root() -> Path:
    return Path(os.environ.get("DMC_CACHE") or Path.home() / ".cache" / "dmc") / "retrofit_quality"


# ----------------------------------------------------------------------------- steps
def run_dmc(args: list[str], log_path: Path) -> dict:
    """``dmc ARGS --json`` in a subprocess (its own megatron state); returns the last JSON line
    it printed. Output goes to ``log_path``; a failure raises with the log's tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    with open(log_path, "a") as log:
        log.write(f"$ dmc {' '.join(args)}\n")
        log.flush()
        done = subprocess.run([sys.executable, "-m", "dmc.cli", *args, "--json"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.write(done.stdout)
    if done.returncode:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"dmc {' '.join(args[:2])} failed (exit {done.returncode}); "
                           f"log {log_path}:\n{tail}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


def ensure_data(d: dict, log) -> Path:
    """The folder ``dmc data prepare`` makes for the data settings ``d`` (cached by them)."""
    folder = cache_root() / f"data-{_hash(d)}"
    if (folder / "meta.json").is_file():
        log(f"data: reusing {folder}")
        return folder
    log(f"data: preparing {folder}")
    run_dmc(["data", "prepare", "--output", str(folder), "--vocab-size", str(d["vocab_size"]),
             "--valid-fraction", str(d["valid_fraction"]), "--seed", str(d["seed"]),
             "--retrieval-fraction", str(d["retrieval_fraction"]),
             "--retrieval-doc-tokens", str(d["retrieval_doc_tokens"]),
             "--retrieval-kinds", ",".join(d["retrieval_kinds"]), "--quiet",
             "--retrieval-loss", d.get("retrieval_loss", "all")],
            folder.parent / f"data-{_hash(d)}.log")
    return folder


def model_args(exp: dict, data: Path) -> list[str]:
    return ["--config", str(ROOT / exp["model"]), f"data.path={data}",
            "logging.progress_bar=false", *exp["model_overrides"]]


def ensure_base(exp: dict, log) -> Path:
    """The pretrained base checkpoint. Each stage of ``base.stages`` pretrains on its data (the
    experiment's, with the stage's changes) from the previous stage's weights, in a folder keyed
    by the hash of the model's settings and of every stage up to it: changing a later stage
    reuses the earlier ones, and a stage is trained once per settings."""
    model = (yaml.safe_load((ROOT / exp["model"]).read_text()), exp["model_overrides"])
    chain, stages = [], []  # (data settings, overrides) of the stages so far; (data, folder)
    for stage in exp["base"]["stages"]:
        chain.append(({**exp["data"], **stage["data"]}, stage["overrides"]))
        stages.append((chain[-1][0], cache_root() / f"base-{_hash(model, chain)}"))
    final = stages[-1][1] / "checkpoints" / "pretrain"
    if (final / "state.json").is_file():
        log(f"base: reusing the cached base {final}")
        return final
    missing = sum(not (d / "checkpoints" / "pretrain" / "state.json").is_file() for _, d in stages)
    log(f"base: {missing} of {len(stages)} stages not cached for these settings: PRETRAINING them "
        f"now (44 min measured on 2 CPU cores for the whole full config). Pass --base PATH "
        f"to use another.")
    previous = []
    for i, ((data_settings, run_dir), stage) in enumerate(zip(stages, exp["base"]["stages"])):
        checkpoint = run_dir / "checkpoints" / "pretrain"
        if (checkpoint / "state.json").is_file():
            log(f"base: stage {i + 1}/{len(stages)}: reusing {run_dir}")
        else:
            data = ensure_data(data_settings, log)
            log(f"base: stage {i + 1}/{len(stages)}: training {run_dir}")
            run_dmc(["pretrain", *model_args(exp, data), f"run_dir={run_dir}",
                     *stage["overrides"], "checkpoint.save_interval=250", *previous],
                    run_dir / "train.log")
        previous = [f"checkpoint.load_base={checkpoint}"]
    return final


def checkpoint_key(folder: Path) -> str:
    from dmc.megatron.checkpoint import content_digest  # content, not place, keys the runs
    return content_digest(folder)[:10]


def run_plans(exp: dict, base: Path, out: Path) -> list[tuple[str, list[str], Path]]:
    """``(name, overrides, start checkpoint)`` of the control, DMC (and variant) and GQA runs;
    makes the GQA runs' starting checkpoints (KV heads mean-pooled) when missing."""
    from dmc.training.config import load_config

    model = load_config([ROOT / exp["model"]], exp["model_overrides"]).model
    heads = model.num_query_groups or model.num_attention_heads
    plans = [("control", ["dmc.enabled=false"], base)]
    plans += [(f"dmc{cr:g}", ["dmc.enabled=true", f"dmc.target_cr={cr}"], base)
              for cr in exp["dmc_crs"]]
    plans += [(v["name"], ["dmc.enabled=true", f"dmc.target_cr={v['cr']}", *v["overrides"]],
               base) for v in exp["variants"]]
    for factor in exp["gqa_factors"]:
        groups = heads // int(factor)
        if groups < 1 or heads % int(factor):
            raise ValueError(f"gqa_factors: {factor} does not divide the {heads} KV heads")
        init = out / "gqa_init" / f"kv{groups}-{checkpoint_key(base)}"
        if not (init / "state.json").is_file():
            run_dmc(["baseline", "gqa", "--checkpoint", str(base), "--num-query-groups",
                     str(groups), "--output", str(init)], out / "gqa_init" / "convert.log")
        plans.append((f"gqa{factor:g}", ["dmc.enabled=false", f"model.num_query_groups={groups}"],
                      init))
    return plans


def train_runs(exp: dict, data: Path, base: Path, out: Path, log) -> dict[str, Path]:
    """Under ``out/runs``: the control, DMC (and variant) and GQA runs, all with the same steps,
    ``data`` (the retrofit data folder), data order and LR; returns name -> final checkpoint. A
    finished run is reused, an interrupted one resumed. The plain DMC runs share the first one's
    zero-out phase (it does not depend on the target CR) through ``checkpoint.init_from``: the
    first plain DMC run whose zero_out folder is complete (one that continued another's has
    none, and a schedule without zero-out steps writes none)."""
    from dmc.megatron.checkpoint import is_complete

    common = [*model_args(exp, data), *exp["retrofit"]["overrides"],
              "checkpoint.save_interval=0"]
    model_yaml = ROOT / exp["model"]  # its settings, not its path or comments, key the runs
    portable = [yaml.safe_load(model_yaml.read_text()) if arg == str(model_yaml) else
                f"data.path={data.name}" if arg == f"data.path={data}" else arg for arg in common]
    plain_dmc = {f"dmc{cr:g}" for cr in exp["dmc_crs"]}
    finals, shared_zero_out = {}, None
    for name, extra, start in run_plans(exp, base, out):
        folder = name.replace("/", "_")  # a variant name like "DMC lr/4" is one folder
        run_dir = out / "runs" / f"{folder}-{_hash(portable, extra, checkpoint_key(start))}"
        finals[name] = run_dir / "checkpoints" / "solidify"
        if (finals[name] / "state.json").is_file():
            log(f"{name}: reusing {finals[name]}")
        else:
            shared = [f"checkpoint.init_from={shared_zero_out}"] if (
                name in plain_dmc and shared_zero_out) else []
            log(f"{name}: training {run_dir}")
            started = time.time()
            run_dmc(["retrofit", *common, *extra, f"run_dir={run_dir}",
                     f"checkpoint.load_base={start}", *shared], run_dir / "train.log")
            log(f"{name}: {time.time() - started:.0f} s")
        zero_out = run_dir / "checkpoints" / "zero_out"
        if name in plain_dmc and shared_zero_out is None and is_complete(zero_out):
            shared_zero_out = zero_out  # a run that continued another's has no zero_out folder
    return finals


# ----------------------------------------------------------------------------- evaluation
def evaluate(exp: dict, data: Path, base: Path, finals: dict, out: Path, log) -> list[dict]:
    """Every method through the engine; the intermediate DMC checkpoints get the label
    ``DMC path``. Returns :func:`dmc.eval.compare.run_methods`'s results."""
    from dmc.eval.compare import Method, load_eval_data, run_methods

    e = exp["eval"]
    eval_data = load_eval_data(str(data), e["seq_len"], e["num_sequences"],
                               e["prefill_fraction"], e["needle_lengths"], e["needle_depths"],
                               e["needles_per_cell"], e["seed"])
    methods = [Method("control", "control", str(finals["control"])),
               Method("base", "base", str(base))]
    methods += [Method("dmc", "DMC", str(finals[f"dmc{cr:g}"])) for cr in exp["dmc_crs"]]
    methods += [Method("dmc", v.get("label", v["name"]), str(finals[v["name"]]))
                for v in exp["variants"]]
    methods += [Method("gqa", "GQA", str(finals[f"gqa{f:g}"])) for f in exp["gqa_factors"]]
    methods += [Method("policy", name.upper(), policy=name, cr=float(cr))
                for name in exp["policies"] for cr in exp["policy_crs"]]
    if exp["dmc_crs"]:
        largest = finals[f"dmc{max(exp['dmc_crs']):g}"].parent
        for cr in exp["intermediate_crs"]:
            checkpoint = largest / f"cr_{float(cr):.1f}"
            if (checkpoint / "state.json").is_file():
                methods.append(Method("dmc", "DMC path", str(checkpoint)))
            else:
                log(f"no intermediate checkpoint {checkpoint}")
    return run_methods(methods, eval_data, batch_size=e["batch_size"], workers=e["workers"],
                       log=log)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", metavar="FILE.yaml",
                        help=f"experiment file; repeat to merge several, later ones win "
                        f"(default: {DEFAULT_CONFIG.relative_to(ROOT)})")
    parser.add_argument("--quick", action="store_true",
                        help="the same pipeline at smoke-test size (the file's quick section)")
    parser.add_argument("--base", metavar="PATH",
                        help="a pretrained base checkpoint to use instead of the cached one")
    parser.add_argument("--output", metavar="DIR", help="default: the file's output")
    parser.add_argument("--out", metavar="FILE.json", help="also copy results.json here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> dict:
    exp = load_experiment(args.config or [DEFAULT_CONFIG], args.quick)
    root = Path(args.output or ROOT / exp["output"])
    out = root / (exp["name"] + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    timings, started = {}, time.time()

    def stage(name, fn, *a):
        t = time.time()
        value = fn(*a)
        timings[name] = round(time.time() - t, 1)
        return value

    data = stage("data", ensure_data, exp["data"], log)
    if args.base:
        base = Path(args.base)
        if not (base / "state.json").is_file():  # keyed by content, manifest or not
            raise ValueError(f"--base {base}: not a checkpoint folder (no state.json)")
        log(f"base: {base} (given)")
    else:
        base = stage("base", ensure_base, exp, log)
    retrofit_data = ensure_data({**exp["data"], **exp["retrofit"]["data"]}, log)
    finals = stage("train", train_runs, exp, retrofit_data, base, root, log)
    results = stage("evaluate", evaluate, exp, data, base, finals, out, log)
    from dmc.eval.compare import write_report
    from dmc.eval.compare_report import checkpoint_table, plot_checkpoints
    from dmc.eval.run_metrics import add_steps_to_cr

    path_rows = [r for r in results if r["label"] == "DMC path"]
    main_rows = [r for r in results if r["label"] != "DMC path"]
    add_steps_to_cr(main_rows, finals.values())
    report = write_report(main_rows, out / "compare", {"experiment": exp, "data": str(data),
                                                       "base": str(base)})
    final = next((r for r in main_rows if r["method"] == "dmc"
                  and r["path"] == str(finals.get(f"dmc{max(exp['dmc_crs'], default=0):g}"))),
                 None)
    if path_rows:
        plot_checkpoints(path_rows, final, out / "dmc_checkpoints.png")
    timings["total"] = round(time.time() - started, 1)
    summary = {"experiment": exp, "quick": args.quick, "data": str(data), "base": str(base),
               "retrofit_data": str(retrofit_data), "timings_s": timings,
               "runs": {k: str(v) for k, v in finals.items()},
               "table": report["table"], "needle_table": report["needle_table"],
               "checkpoint_table": checkpoint_table(path_rows) if path_rows else "",
               "results": main_rows, "checkpoints": path_rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    tables = (report["table"], report["needle_table"], summary["checkpoint_table"])
    (out / "table.md").write_text("\n\n".join(t for t in tables if t) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"retrofit_quality: error: {err}", file=sys.stderr)
        return 2
    tables = (summary["table"], summary["needle_table"], summary["checkpoint_table"])
    print("\n" + "\n\n".join(t for t in tables if t))
    print(f"\ntimings (s): {summary['timings_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
