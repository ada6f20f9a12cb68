"""``dmc baseline gqa``: convert a vanilla checkpoint to GQA by mean-pooling KV heads."""
from __future__ import annotations

import argparse
import json


def kv_factor(path) -> tuple[int, int]:
    """``(source KV heads, factor)`` of the GQA conversion at ``path``: the factor is the source's
    KV heads over the converted model's (``heads / groups`` for an MHA source)."""
    from dmc.megatron.checkpoint import read_state

    state = read_state(path)
    source = state["source_num_query_groups"]
    return source, source // state["model_config"]["num_query_groups"]


def run_gqa(args: argparse.Namespace) -> int:
    from dmc.baselines.gqa import convert_to_gqa

    path = convert_to_gqa(args.checkpoint, args.num_query_groups, args.output)
    result = {"output": str(path), "num_query_groups": args.num_query_groups}
    if args.json:
        print(json.dumps(result))
    else:
        source, factor = kv_factor(path)
        print(f"GQA model with {args.num_query_groups} KV heads ({factor}x fewer than the "
              f"source's {source}) written to {path}; up-train it with the {factor}x recipe: "
              f"dmc retrofit --config configs/models/<model>.yaml --config "
              f"configs/retrofit/gqa{factor}.yaml model.num_query_groups={args.num_query_groups} "
              f"checkpoint.load_base={path} (for an equal training budget, with the schedule of "
              f"the DMC {factor}x run it is compared with)")
    return 0


def register(sub) -> None:
    parser = sub.add_parser("baseline", help="build the baselines DMC is compared against")
    baseline_sub = parser.add_subparsers(dest="baseline_command", required=True)
    gqa = baseline_sub.add_parser(
        "gqa", help="MHA -> GQA by mean-pooling the K/V heads of each group (Ainslie et al.)")
    gqa.add_argument("--checkpoint", required=True, metavar="PATH",
                     help="a vanilla model: checkpoint folder, run folder or inference .pt file")
    gqa.add_argument("--num-query-groups", type=int, required=True, metavar="N",
                     help="KV heads after conversion (must divide the model's KV heads)")
    gqa.add_argument("--output", required=True, metavar="DIR",
                     help="new checkpoint folder (must not exist)")
    gqa.add_argument("--json", action="store_true", help="print the result as JSON")
    gqa.set_defaults(handler=run_gqa)
