"""``dmc data prepare``: corpus -> tokenizer -> megatron indexed dataset."""
from __future__ import annotations


def register(sub) -> None:
    from dmc.data.prepare import add_prepare_arguments, run_prepare

    data = sub.add_parser("data", help="corpus -> tokenizer -> megatron indexed dataset")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="prepare a training corpus")
    add_prepare_arguments(prepare)
    prepare.set_defaults(handler=run_prepare)
