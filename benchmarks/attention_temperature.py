"""How sharp a checkpoint's training objective wants its attention heads (a diagnostic).

    python benchmarks/attention_temperature.py CHECKPOINT DATA_DIR [--documents queried|all]
        [--length-term] [--steps 100] [--lr 0.03] [--probe 512,1024] [--needles 80] [--seeds 3,5]
        [--json PATH]

Every weight frozen, each head's queries are multiplied by ``exp(tau[layer, head])`` (its attention
logits by the same factor: RoPE rotates q linearly, so a fitted scale folds into the head's rows of
W_q and the model stays a Llama), and ``tau`` (zeros at the start) is fitted by Adam over
``--steps`` batches of 4 x ``--seq-length`` tokens of DATA_DIR's train split, scored with its loss
mask (``dmc data prepare --retrieval-loss queries`` writes one; without it every token counts):

* ``--documents all``: samples of the whole mix, as the trainer draws them;
* ``--documents queried``: only the documents whose loss mask starts at 0 (kv, needle and decoy
  documents, scored on their queries), the last ``--seq-length + 1`` tokens of each (the
  queries are at the end), taken from the split's end.

With ``--length-term`` each head also gets a slope ``gamma[layer, head]`` (zeros at the start) and
its factor at position ``p`` becomes ``exp(tau + gamma * log((p + 1) / 256))``: a query sharper the
more keys it attends over (the log-length scaling of Nakanishi's Scalable-Softmax and Llama 4's
attention temperature tuning), ``exp(tau)`` the factor at position 255; not foldable into W_q.

Prints the loss of 8 further batches (not fitted on) before and after, and the scales ``exp(tau)``
(and the slopes).
Scales near 1 with an unchanged loss say the trained temperature is what that objective wants;
scales far from 1 with a lower loss say it wants something training did not reach. With
``--probe``, the needle probe of ``benchmarks/needle_probe.py`` (DATA_DIR's held-out split, exact
match, mean over ``--seeds``) is run with the trained and with the fitted temperatures. Fitting on
``queried`` documents asks what the retrieval queries alone want, which is not the model's
training objective: a diagnostic, not a recipe.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dmc.data.indexed import (build_gpt_dataset, loss_mask_prefix, read_indexed_dataset,
                              window_weights)
from dmc.data.prepare import load_meta, split_prefix
from dmc.data.tokenizer import load_tokenizer
from dmc.inference.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle_probe import probe  # noqa: E402

DOCUMENTS = ("all", "queried")
BATCH = 4
HELD_OUT_BATCHES = 8
LENGTH_REFERENCE = 256  # the position + 1 at which the length term is 0


def attach_query_scales(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Register, on every megatron core attention of ``model``, a hook multiplying its query
    ``[seq, batch, heads, head_dim]`` at position ``p`` (its index along ``seq``: the samples
    start at position 0) by ``exp(tau[layer, head] + gamma[layer, head] * log((p + 1) / 256))``;
    returns ``tau, gamma`` ``[layers, heads]`` (zeros, requiring grad)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    shape = (len(cores), cores[0].num_attention_heads_per_partition)
    tau, gamma = torch.zeros(shape, requires_grad=True), torch.zeros(shape, requires_grad=True)

    def hook(layer):
        def scale_query(module, args):
            query = args[0]
            log_length = torch.log(torch.arange(1, query.shape[0] + 1, dtype=query.dtype)
                                   / LENGTH_REFERENCE)
            factor = (tau[layer] + gamma[layer] * log_length[:, None]).exp()  # [seq, heads]
            return (query * factor[:, None, :, None],) + tuple(args[1:])
        return scale_query

    for layer, core in enumerate(cores):
        core.register_forward_pre_hook(hook(layer))
    return tau, gamma


def masked_loss(model, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose ``loss_mask`` is 1."""
    logits = model(batch["tokens"], batch["position_ids"], None)
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                             reduction="none")
    mask = batch["loss_mask"].flatten().float()
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def fit(model, parameters: list[torch.Tensor], batches: list[dict], lr: float) -> None:
    """One Adam step on ``parameters`` per batch, minimising :func:`masked_loss`."""
    optimizer = torch.optim.Adam(parameters, lr=lr)
    for batch in batches:
        optimizer.zero_grad()
        masked_loss(model, batch).backward()
        optimizer.step()


def _stack(samples: list[dict]) -> dict:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]).long()
            for key in ("tokens", "labels", "loss_mask", "position_ids")}


def batches_from(data: str, documents: str, seq_length: int, count: int) -> list[dict]:
    """``count`` batches of ``BATCH`` samples (see the module docstring)."""
    train = split_prefix(data, "train")
    if documents == "all":
        meta = load_meta(data)
        tokenizer = load_tokenizer(Path(data) / meta["tokenizer"]["path"])
        dataset = build_gpt_dataset(train, seq_length, count * BATCH, 0, tokenizer)
        return [_stack([dataset[i * BATCH + k] for k in range(BATCH)]) for i in range(count)]
    mask_prefix = loss_mask_prefix(train)
    if not mask_prefix.with_suffix(".idx").is_file():
        raise ValueError(f"--documents queried: {data} holds no loss mask beside its train split "
                         f"(prepare it with --retrieval-loss queries)")
    tokens, masks = read_indexed_dataset(str(train)), read_indexed_dataset(str(mask_prefix))
    chosen = [i for i in range(len(masks) - 1, -1, -1)
              if len(masks[i]) > seq_length and masks[i][0] == 0][:count * BATCH]
    if len(chosen) < count * BATCH:
        raise ValueError(f"--documents queried: {data} holds {len(chosen)} queried documents of "
                         f"more than {seq_length} tokens; {count * BATCH} are needed")
    samples = []
    for i in chosen:
        ids, mask = (torch.as_tensor(list(x[i][-(seq_length + 1):])) for x in (tokens, masks))
        samples.append({"tokens": ids[:-1], "labels": ids[1:],
                        "loss_mask": window_weights(mask[1:]),
                        "position_ids": torch.arange(seq_length)})
    return [_stack(samples[i * BATCH:(i + 1) * BATCH]) for i in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data", help="a `dmc data prepare` folder")
    parser.add_argument("--documents", default="queried")
    parser.add_argument("--length-term", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--probe", metavar="LENGTHS", help="e.g. 512,1024")
    parser.add_argument("--needles", type=int, default=80)
    parser.add_argument("--seeds", default="3,5")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.documents not in DOCUMENTS:
        print(f"--documents: {args.documents!r} not accepted; choose from {', '.join(DOCUMENTS)}",
              file=sys.stderr)
        return 2
    for flag, value in (("--steps", args.steps), ("--seq-length", args.seq_length)):
        if value < 1:
            print(f"{flag}: accepted values >= 1, got {value}", file=sys.stderr)
            return 2
    try:
        lengths = [int(x) for x in args.probe.split(",")] if args.probe else []
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        print(f"--probe and --seeds: expected comma-separated integers, got {args.probe!r}, "
              f"{args.seeds!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    try:
        batches = batches_from(args.data, args.documents, args.seq_length,
                               args.steps + HELD_OUT_BATCHES)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    model = load_model(args.checkpoint).model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tau, gamma = attach_query_scales(model)
    fitted_parameters = [tau, gamma] if args.length_term else [tau]
    held_out = batches[args.steps:]

    def held_out_loss() -> float:
        with torch.no_grad():
            return sum(masked_loss(model, b).item() for b in held_out) / len(held_out)

    before = held_out_loss()
    fit(model, fitted_parameters, batches[:args.steps], args.lr)
    result = {"checkpoint": args.checkpoint, "documents": args.documents, "steps": args.steps,
              "loss_before": before, "loss_after": held_out_loss(),
              "scales": tau.detach().exp().tolist(), "slopes": gamma.detach().tolist()}
    print(f"held-out loss ({args.documents}): {before:.4f} -> {result['loss_after']:.4f}")
    for layer, scales in enumerate(result["scales"]):
        print(f"layer {layer}: scales " + " ".join(f"{s:.2f}" for s in scales)
              + (" | slopes " + " ".join(f"{g:.3f}" for g in result["slopes"][layer])
                 if args.length_term else ""))
    if lengths:
        stream = [t for doc in read_indexed_dataset(str(split_prefix(args.data, "valid")))
                  for t in doc]
        fitted = [p.detach().clone() for p in (tau, gamma)]
        result["probe"] = {}
        for name, values in (("trained", [torch.zeros_like(p) for p in fitted]),
                             ("fitted", fitted)):
            for parameter, value in zip((tau, gamma), values):
                parameter.data.copy_(value)
            exact = {n: sum(probe(model, stream, n, args.needles, s)["exact"] for s in seeds)
                     / len(seeds) for n in lengths}
            result["probe"][name] = exact
            print(f"needles exact, {name} temperatures: "
                  + " | ".join(f"{n}: {e:.2f}" for n, e in exact.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
