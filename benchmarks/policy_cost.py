"""What each training-free KV policy costs per decode step: the time of its hooks and the memory of
its state, against the vanilla engine, in one run.

Every mode serves the same ``--batch`` requests (``--prompt-len`` random tokens, ``--gen-len``
greedy new tokens) on the same random-weight vanilla model, with ample pages (memory is measured,
not budgeted). Modes: ``vanilla`` and every policy of ``--policies`` (default: all of
``dmc.policies.POLICY_NAMES``, each at its defaults and its paper's schedule, at ``--cr``), plus
``omnikv (resident)``, OmniKV without offload (``offload=False``), when OmniKV is among them.
All modes run **interleaved step by step** (one ``Engine.step`` of each in turn, the order rotated
every round), so that the machine's drift lands on every mode alike.

Per mode, over the decode-only steps at the full batch (medians):

* ``step_ms``: the whole forward (model, cache writes and attention, the policy's hooks);
* ``policy_ms``: the time spent in the policy hooks of the engine (:class:`PolicyRunner`'s
  ``observe``: the newest queries' attention over the cache and the policy's statistics;
  ``decode_attention``: OmniKV's resident sparse attention; ``evict``: selection, compaction,
  re-rotation, OmniKV's offload); vanilla's no-op hooks give the floor;
* ``overhead``: ``step_ms`` over vanilla's.

Memory per sequence, at its peak over the decode steps: ``state_held`` (what
:meth:`Engine.sequence_bytes` counts as ``policy_state``: positions and per-slot state of the held
slots, per-sequence windows and statistics, re-rotation key copies), ``state_allocated`` (every
tensor the runner and the policy allocate, divided by the sequence slots: it is allocated for
``max_slots`` per head whatever is held), ``kv`` (device pages), ``host`` (OmniKV's host pool)
and the measured CR (device slots, mean over the requests at their end). Transient tensors of a
step (the attention probabilities, scores) are not counted.

Presets: ``cpu`` (default): 8 layers (so that OmniKV's scaled filter layers {0, 2, 4} leave sparse
layers 6 and 7), hidden 256, 4 heads, 2 KV heads, fp32, batch 4, P = 256, G = 64, CR 4; ``tiny``:
the same shape at hidden 32, P = 24, G = 6 (tests). Any flag overrides its preset.

    OMP_NUM_THREADS=1 python benchmarks/policy_cost.py --out policy_cost.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", module="megatron")

PRESETS = {
    "cpu": dict(layers=8, hidden=256, heads=4, groups=2, ffn=512, vocab=512, batch=4,
                prompt_len=256, gen_len=64, chunk_size=256, page_size=16, cr=4.0),
    "tiny": dict(layers=8, hidden=32, heads=4, groups=2, ffn=64, vocab=64, batch=2,
                 prompt_len=24, gen_len=6, chunk_size=16, page_size=4, cr=4.0),
}
HOOKS = ("observe", "decode_attention", "evict")
RESIDENT = "omnikv (resident)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in PRESETS["cpu"]:
        kind = float if name == "cr" else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind,
                       help=f"default: the preset's ({PRESETS['cpu'][name]} for cpu)")
    p.add_argument("--policies", help="comma-separated NAME or NAME@SCHEDULE (default: all)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("batch", "prompt_len", "gen_len", "chunk_size", "page_size", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.gen_len < 3:
        p.error(f"--gen-len: must be >= 3 (the engine step that ends the prefill draws a "
                f"request's first two tokens; the costs are measured on the decode-only steps "
                f"after it), got {args.gen_len}")
    if not (math.isfinite(args.cr) and args.cr >= 1):
        p.error(f"--cr: must be a finite number >= 1, got {args.cr}")
    try:  # the model's shape and the policies named, checked before anything is built
        model_config(args)
        mode_names(args)
    except ValueError as err:
        p.error(str(err))
    return args


def mode_names(args) -> list[str]:
    """``vanilla``, the policy specs, and OmniKV resident after OmniKV."""
    from dmc.policies import POLICY_NAMES, parse_policy_spec

    specs = [s.strip() for s in args.policies.split(",")] if args.policies else list(POLICY_NAMES)
    for spec in specs:
        parse_policy_spec(spec)
    modes = ["vanilla"]
    for spec in specs:
        modes.append(spec)
        if spec == "omnikv":
            modes.append(RESIDENT)
    return modes


def model_config(args):
    """The random model's :class:`~dmc.megatron.config.ModelConfig` (ConfigError naming a bad
    field)."""
    from dmc.megatron.config import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, num_query_groups=args.groups,
                       ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                       max_seq_length=args.prompt_len + args.gen_len)


def build_model(args):
    from dmc.megatron.model import build_model_from_config

    torch.manual_seed(args.seed)
    model = build_model_from_config(model_config(args), None)
    return model.cuda() if torch.cuda.is_available() else model


class Clock:
    """Seconds spent in wrapped methods since the last :meth:`take` (CUDA: synchronised)."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds = cuda, 0.0

    def wrap(self, method):
        def timed(*args, **kwargs):
            self._sync()
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._sync()
                self.seconds += time.perf_counter() - started
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Run:
    """One mode's engine, its requests and what its decode steps measured."""

    def __init__(self, name: str, model, args, prompts, cuda: bool):
        from dmc.inference import Engine, SamplingParams
        from dmc.policies import policy_from_spec

        policy = None
        if name == RESIDENT:
            policy = policy_from_spec("omnikv", args.cr, offload=False)
        elif name != "vanilla":
            policy = policy_from_spec(name, args.cr)
        self.name, self.cuda = name, cuda
        self.engine = Engine(model, dmc=None, page_size=args.page_size, max_batch=args.batch,
                             max_seq_len=args.prompt_len + args.gen_len,
                             chunk_size=args.chunk_size, seed=args.seed, policy=policy)
        self.clock = Clock(cuda)
        hooks = self.engine.policy  # a PolicyRunner, or the engine's no-op hooks
        for hook in HOOKS:
            setattr(hooks, hook, self.clock.wrap(getattr(hooks, hook)))
        for prompt in prompts:
            self.engine.add_request(prompt, SamplingParams(max_new_tokens=args.gen_len))
        self.batch = len(prompts)
        self.steps: list[tuple[float, float]] = []  # (step s, policy s) of decode-only steps
        self.peak = {"state_held": 0, "kv": 0, "host": 0}
        self.crs: list[float] = []  # measured CR of each finished request

    def step(self) -> None:
        stats = self.engine.stats
        prefilled, decoded = stats.prefill_tokens, stats.decode_tokens
        self.clock.take()
        if self.cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        finished = self.engine.step()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        policy = self.clock.take()
        if stats.prefill_tokens == prefilled and stats.decode_tokens - decoded == self.batch:
            self.steps.append((seconds, policy))
            self._note_memory()
        self.crs += [result.compression.overall for result in finished]

    def _note_memory(self) -> None:
        from dmc.inference.scoring import held_bytes

        for seq in self.engine.scheduler.running:
            held = held_bytes(self.engine, seq.slot)
            for key, name in (("state_held", "policy_state"), ("kv", "kv"), ("host", "host")):
                self.peak[key] = max(self.peak[key], held[name])

    def allocated_state(self) -> int:
        """Bytes of every tensor the policy runner and its policy hold, per sequence slot."""
        runner = self.engine.policy
        owners = [runner, getattr(runner, "policy", None), getattr(runner, "rerotation", None)]
        owners.append(getattr(owners[1], "base", None))  # a wrapper's base policy
        tensors = {id(t): t for owner in owners if owner is not None
                   for t in vars(owner).values() if isinstance(t, torch.Tensor)}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return total // self.engine.max_batch

    def row(self, vanilla_ms: float | None) -> dict:
        if not self.steps:
            raise SystemExit(f"{self.name}: no decode-only step at the full batch was measured")
        step_ms = 1e3 * statistics.median(s for s, _ in self.steps)
        policy_ms = 1e3 * statistics.median(p for _, p in self.steps)
        return {"mode": self.name, "decode_steps": len(self.steps), "step_ms": step_ms,
                "policy_ms": policy_ms, "overhead": step_ms / (vanilla_ms or step_ms),
                "state_allocated": self.allocated_state(), **self.peak,
                "slots_cr": statistics.fmean(self.crs)}


def run_all(args) -> list[dict]:
    cuda = torch.cuda.is_available()
    model = build_model(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]
    runs = [Run(name, model, args, prompts, cuda) for name in mode_names(args)]
    rounds = 0
    while any(r.engine.has_unfinished() for r in runs):
        shift = rounds % len(runs)
        for run in runs[shift:] + runs[:shift]:
            if run.engine.has_unfinished():
                run.step()
        rounds += 1
    vanilla = runs[0].row(None)
    return [vanilla] + [run.row(vanilla["step_ms"]) for run in runs[1:]]


def table(rows: list[dict]) -> str:
    head = ("| mode | step ms | policy ms | x vanilla step | state held | state allocated | "
            "KV (device) | host | CR (slots) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['step_ms']:.2f} | {r['policy_ms']:.2f} | "
                     f"{r['overhead']:.2f} | {_kib(r['state_held'])} | "
                     f"{_kib(r['state_allocated'])} | {_kib(r['kv'])} | {_kib(r['host'])} | "
                     f"{r['slots_cr']:.2f} |")
    return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = run_all(args)
    print(f"policy cost on {device} ({args.preset} preset): {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads / {args.groups} KV heads, batch {args.batch}, "
          f"P = {args.prompt_len}, G = {args.gen_len}, CR {args.cr:g}; medians over the "
          f"decode steps, memory per sequence at its peak")
    print(table(rows))
    report = {"device": device, "config": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
