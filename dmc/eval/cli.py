"""``dmc eval``: quality with the real compressed cache (``ppl``, ``compare``)."""
from __future__ import annotations


def register(sub) -> None:
    from dmc.eval.compare import add_compare_arguments, run_compare
    from dmc.eval.perplexity import add_ppl_arguments, run_ppl

    parser = sub.add_parser("eval", help="evaluate a model with its compressed KV cache")
    eval_sub = parser.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser("ppl", help="perplexity on held-out tokens (teacher forcing "
                              "through the engine), measured CR per layer and head")
    add_ppl_arguments(ppl)
    ppl.set_defaults(handler=run_ppl)
    compare = eval_sub.add_parser(
        "compare", help="vanilla vs DMC vs GQA vs KV policies at several CRs: perplexity and "
        "needle retrieval with each real cache (DMC paper, Table 1); table, JSON and plot")
    add_compare_arguments(compare)
    compare.set_defaults(handler=run_compare)
