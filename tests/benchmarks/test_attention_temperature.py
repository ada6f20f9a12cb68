"""benchmarks/attention_temperature.py: a head's query scale multiplies its attention logits
(== needle_probe's softmax-scale factor when every head gets it), the length term scales
position p by exp(gamma * log((p + 1) / 256)), the fit lowers the masked loss
it fits, queried documents are the masked ones, and bad options exit 2 naming the option."""
import math

import pytest
import torch

from conftest import load_benchmark, text_corpus

bench = load_benchmark("attention_temperature")
probe_bench = load_benchmark("needle_probe")


@pytest.fixture()
def tiny_vanilla(parallel_1x1, one_thread):
    from tiny_models import VOCAB, build_tiny

    model, _ = build_tiny(4, seed=5)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tokens = torch.randint(0, VOCAB, (2, 41), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": torch.ones(2, 40, dtype=torch.long),
             "position_ids": torch.arange(40)[None].expand(2, -1)}
    return model, batch


def test_query_scales_multiply_each_heads_attention_logits(tiny_vanilla):
    model, batch = tiny_vanilla
    tau, gamma = bench.attach_query_scales(model)
    assert tau.shape == gamma.shape == (2, 4) and not tau.any() and not gamma.any()

    def logits():
        with torch.no_grad():
            return model(batch["tokens"], batch["position_ids"], None)

    trained = logits()
    tau.data.fill_(math.log(2.0))
    doubled_queries = logits()
    tau.data.zero_()
    probe_bench.scale_attention(model, "2")
    torch.testing.assert_close(doubled_queries, logits(), rtol=1e-5, atol=1e-5)
    probe_bench.scale_attention(model, "0.5")
    tau.data[1, 2] = 1.0  # one head of the last layer only
    assert not torch.allclose(logits(), trained)


def test_length_term_scales_position_p_by_its_log_length(tiny_vanilla):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model, batch = tiny_vanilla
    tau, gamma = bench.attach_query_scales(model)
    tau.data.fill_(0.3)
    gamma.data[0, 1] = 0.5
    core = next(m for m in model.modules() if isinstance(m, DotProductAttention))
    seen = {}

    def keep(name):
        def hook(module, args):
            seen[name] = args[0]
        return hook

    core.register_forward_pre_hook(keep("before"), prepend=True)
    core.register_forward_pre_hook(keep("after"))
    with torch.no_grad():
        model(batch["tokens"], batch["position_ids"], None)
    positions = torch.arange(40, dtype=torch.float64)
    factor = torch.full((40, 4), 0.3, dtype=torch.float64)
    factor[:, 1] += 0.5 * torch.log((positions + 1) / 256)
    expected = seen["before"].double() * factor.exp()[:, None, :, None]
    torch.testing.assert_close(seen["after"].double(), expected, rtol=1e-5, atol=1e-6)


def test_fit_lowers_the_masked_loss_it_fits(tiny_vanilla):
    model, batch = tiny_vanilla
    tau, gamma = bench.attach_query_scales(model)
    batch["loss_mask"][:, :20] = 0
    with torch.no_grad():
        before = bench.masked_loss(model, batch).item()
    bench.fit(model, [tau, gamma], [batch] * 5, lr=0.05)
    assert tau.abs().min() > 0 and gamma.abs().min() > 0  # the gradient reaches every head
    with torch.no_grad():
        assert bench.masked_loss(model, batch).item() < before


def test_queried_batches_are_the_masked_documents(tmp_path):
    from dmc.data.prepare import prepare_data

    corpus_dir = text_corpus(tmp_path / "corpus")
    prepare_data([corpus_dir], tmp_path / "out", vocab_size=300, valid_fraction=0.2, quiet=True,
                 retrieval_fraction=0.5, retrieval_doc_tokens=256,
                 retrieval_kinds=["needle", "copy"], retrieval_loss="queries")
    batches = bench.batches_from(str(tmp_path / "out"), "queried", 128, 2)
    assert len(batches) == 2
    for batch in batches:
        assert batch["tokens"].shape == batch["loss_mask"].shape == (bench.BATCH, 128)
        torch.testing.assert_close(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert (batch["loss_mask"][:, 0] == 0).all() and (batch["loss_mask"] == 1).any()
    with pytest.raises(ValueError, match="queried documents of more than 128 tokens; 400"):
        bench.batches_from(str(tmp_path / "out"), "queried", 128, 100)
    plain = bench.batches_from(str(tmp_path / "out"), "all", 64, 1)[0]
    assert plain["tokens"].shape == (bench.BATCH, 64)


def test_bad_options_exit_2_naming_the_option(tiny_data, capsys):
    assert bench.main(["ckpt", str(tiny_data), "--documents", "needles"]) == 2
    assert "--documents: 'needles' not accepted; choose from all, queried" in (
        capsys.readouterr().err)
    assert bench.main(["ckpt", str(tiny_data)]) == 2  # queried, but no loss mask
    assert "no loss mask beside its train split" in capsys.readouterr().err
    assert bench.main(["ckpt", str(tiny_data), "--probe", "512,x"]) == 2
    assert "--probe and --seeds" in capsys.readouterr().err
    for flags in (["--seq-length", "0"], ["--steps", "0"], ["--steps", "-3"]):
        assert bench.main(["ckpt", str(tiny_data), "--documents", "all", *flags]) == 2
        assert f"{flags[0]}: accepted values >= 1, got {flags[1]}" in capsys.readouterr().err
