"""Perplexity with the real compressed cache equals the eval-mode model's full forward."""
import argparse
import json
import math

import pytest
import torch

from dmc.eval import evaluate_perplexity, load_token_sequences, model_perplexity, token_windows
from dmc.eval.perplexity import add_ppl_arguments, run_ppl
from dmc.inference import Engine, save_inference_state
from dmc.megatron.attention import dmc_layers
from dmc.megatron.runtime import DMCConfig
from tiny_models import VOCAB, build_tiny


pytestmark = pytest.mark.usefixtures("one_thread")


def build(groups, window="vanilla", c=-1.0):
    return build_tiny(groups, window, c, max_seq=128, scale=0.4)[0]


def held_out(n=3, length=48, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=gen).tolist()


@pytest.mark.parametrize("groups,window", [(2, 3), (4, None), (2, "vanilla")])
def test_engine_perplexity_equals_full_forward(parallel_1x1, groups, window):
    model = build(groups, window)
    sequences = held_out()
    engine = Engine(model, page_size=4, max_batch=1, chunk_size=10)
    result = evaluate_perplexity(engine, sequences)
    reference = model_perplexity(model, sequences)
    assert result["tokens"] == reference["tokens"] == 3 * 47
    assert result["nll"] == pytest.approx(reference["nll"], abs=1e-4)
    assert result["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4)
    comp = result["compression"]
    assert comp["tokens"] == 3 * 48
    assert len(comp["per_layer"]) == 2 and len(comp["per_head"][0]) == groups
    if window == "vanilla":
        assert comp["cr"] == 1.0 and result["dmc"] is False
    else:
        assert comp["cr"] > 1.5
        # the cache's slots are the model's kept slots (its eval-mode CR statistics)
        for layer in dmc_layers(model):
            layer.reset_cr_stats()
        model_perplexity(model, sequences)
        kept = torch.stack([layer.cr_kept for layer in dmc_layers(model)])
        assert comp["slots"] == int(kept.sum())
        per_head = (3 * 48 / kept).tolist()
        for got, want in zip(comp["per_head"], per_head):
            assert got == pytest.approx(want)
    assert json.loads(json.dumps(result)) == result  # JSON-able
    assert engine.cache.pages_in_use == 0


def test_score_returns_every_position(parallel_1x1):
    model = build(2, 3)
    tokens = held_out(1, 30)[0]
    score = Engine(model, page_size=4, max_batch=1, chunk_size=7).score(tokens, return_logits=True)
    with torch.no_grad():
        logits = model(torch.tensor(tokens)[None], torch.arange(30)[None], None)[0]
    torch.testing.assert_close(score.logits, logits, atol=1e-4, rtol=1e-4)
    assert score.token_logprobs.shape == (29,)
    assert score.compression.tokens == 30


def test_token_sources(tmp_path):
    stream = list(range(50))
    assert token_windows(stream, 16) == [stream[:16], stream[16:32], stream[32:48]]
    assert token_windows(stream, 16, num_sequences=1) == [stream[:16]]
    torch.save(torch.tensor(stream), tmp_path / "stream.pt")
    assert load_token_sequences(tmp_path / "stream.pt", 25) == [stream[:25], stream[25:]]
    torch.save(torch.arange(12).reshape(3, 4), tmp_path / "rows.pt")
    assert load_token_sequences(tmp_path / "rows.pt", 99, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    from dmc.data.indexed import write_indexed_dataset

    write_indexed_dataset(tmp_path / "valid", [[1, 2, 3], [4, 5]], vocab_size=VOCAB, eod=0)
    assert load_token_sequences(tmp_path / "valid", 4) == [[1, 2, 3, 0]]
    with pytest.raises(FileNotFoundError, match="no tokens"):
        load_token_sequences(tmp_path / "missing", 4)
    with pytest.raises(ValueError, match="seq_len"):
        token_windows(stream, 1)


def _save_pt(value):
    return lambda path: torch.save(value, path)


def _save_npy(values):
    import numpy

    return lambda path: numpy.save(path, numpy.array(values))  # an object array: pickled


@pytest.mark.parametrize("name,write,message", [
    ("corrupt.pt", lambda path: path.write_bytes(b"garbage, not a torch file"),
     r"not a \.pt file of token ids \(UnpicklingError from torch.load\); accepted: "),
    ("dict.pt", _save_pt({"tokens": torch.arange(8)}),
     r"holds a dict, not token ids; accepted: a 1-D token stream"),
    ("float.pt", _save_pt(torch.rand(64)), r"token ids must be integers, got torch.float32"),
    ("bool.pt", _save_pt(torch.ones(64, dtype=torch.bool)),
     r"token ids must be integers, got torch.bool"),
    ("cube.pt", _save_pt(torch.zeros(2, 2, 2, dtype=torch.long)),
     r"expected a 1-D token stream or a 2-D \[N, L\] array of token ids, got 3 dimensions"),
    ("corrupt.npy", lambda path: path.write_bytes(b"garbage, not a numpy file"),
     r"not a \.npy file of token ids \(ValueError from numpy.load\)"),
    ("objects.npy", _save_npy([{"a": 1}, None]),
     r"not a \.npy file of token ids \(ValueError from numpy.load\)"),
    ("strings.npy", _save_npy(["a", "b"]), r"holds an array of <U1, not token ids"),
    ("float.npy", _save_npy([0.5, 1.5]), r"token ids must be integers, got torch.float64"),
])
def test_bad_token_files_name_the_data_flag(tmp_path, name, write, message):
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError, match=f"--data {path}: {message}"):
        load_token_sequences(path, 4)


def test_a_corrupt_token_file_exits_2(tmp_path, capsys):
    from dmc.cli import main

    (tmp_path / "corrupt.pt").write_bytes(b"garbage, not a torch file")
    assert main(["eval", "ppl", "--model", str(tmp_path / "none"), "--data",
                 str(tmp_path / "corrupt.pt")]) == 2
    assert f"--data {tmp_path / 'corrupt.pt'}: not a .pt file" in capsys.readouterr().err


def test_integer_token_files_of_any_width_load(tmp_path):
    import numpy

    numpy.save(tmp_path / "u16.npy", numpy.arange(8, dtype=numpy.uint16))
    torch.save(torch.arange(8, dtype=torch.int32), tmp_path / "i32.pt")
    for name in ("u16.npy", "i32.pt"):
        assert load_token_sequences(tmp_path / name, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_ppl_cli_json(parallel_1x1, tmp_path, capsys):
    model = build(2, 3)
    config = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                  num_query_groups=2, vocab_size=VOCAB, max_seq_length=128)
    save_inference_state(tmp_path / "model.pt", model, config, DMCConfig(window=3, c=-1.0))
    torch.save(torch.tensor(held_out(2, 40)), tmp_path / "tokens.pt")
    parser = add_ppl_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--state-dict", str(tmp_path / "model.pt"), "--data",
                              str(tmp_path / "tokens.pt"), "--chunk-size", "16", "--page-size",
                              "4", "--compare-full-forward", "--json"])
    assert run_ppl(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sequences"] == 2 and out["tokens"] == 78
    assert out["nll"] == pytest.approx(out["full_forward"]["nll"], abs=1e-4)
    assert math.isfinite(out["perplexity"]) and out["compression"]["cr"] > 1.5
    with pytest.raises(ValueError, match="--num-sequences must be >= 1"):
        run_ppl(parser.parse_args(["--state-dict", str(tmp_path / "model.pt"), "--data",
                                   str(tmp_path / "tokens.pt"), "--num-sequences", "0"]))


def full_forward_logprobs(model, tokens):
    """float64 log-probabilities of the eval-mode model's full forward, ``[n, vocab]``."""
    for layer in dmc_layers(model):
        layer.dmc.set_mode("eval")
    with torch.no_grad():
        logits = model(torch.tensor(tokens)[None], torch.arange(len(tokens))[None], None)[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_decoded_only_perplexity_and_kl_against_float64(parallel_1x1, window):
    """With prefill_tokens=P only the decode path's predictions (tokens P+1..n-1) count, and KL /
    top-1 agreement against a reference equal float64 sums over the same positions."""
    model, other = build(2, window), build_tiny(2, "vanilla", max_seq=128, seed=9)[0]
    sequences, prefill = held_out(3, 40), 17
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=8)
    reference = evaluate_perplexity(Engine(other, page_size=4, max_batch=2), sequences,
                                    prefill_tokens=prefill, keep_logprobs=True)
    result = evaluate_perplexity(engine, sequences, prefill_tokens=prefill,
                                 reference=reference["logprobs"], keep_logprobs=True)
    nll, kl, agree = 0.0, 0.0, 0
    for tokens in sequences:
        mine, theirs = full_forward_logprobs(model, tokens), full_forward_logprobs(other, tokens)
        rows = torch.arange(prefill, len(tokens) - 1)  # decode positions predicting P+1..n-1
        nll -= float(mine[rows, torch.tensor(tokens)[rows + 1]].sum())
        kl += float((theirs[rows].exp() * (theirs[rows] - mine[rows])).sum())
        agree += int((theirs[rows].argmax(-1) == mine[rows].argmax(-1)).sum())
    count = 3 * (40 - prefill - 1)
    assert result["tokens"] == count and result["prefill_tokens"] == prefill
    assert result["nll"] == pytest.approx(nll / count, abs=1e-5)
    assert result["kl"] == pytest.approx(kl / count, abs=1e-5)
    assert result["top1_agreement"] == agree / count
    low, high = result["perplexity_ci"]
    assert low <= result["perplexity"] <= high
    itself = evaluate_perplexity(Engine(model, page_size=4, max_batch=3, chunk_size=8),
                                 sequences, prefill_tokens=prefill, reference=result["logprobs"])
    assert itself["kl"] == pytest.approx(0.0, abs=1e-6) and itself["top1_agreement"] == 1.0
    with pytest.raises(ValueError, match="leaves no decoded prediction"):
        evaluate_perplexity(engine, sequences, prefill_tokens=39)


class _StubScorer:
    """An engine whose score_batch hands back fixed float64 token log-probabilities and
    float32 logits per sequence (looked up by its first token), two sequences at a time."""
    max_batch, chunk_size, page_size, dmc = 2, 16, 8, None

    def __init__(self, logprobs, logits):
        self.logprobs, self.logits = logprobs, logits

    def score_batch(self, seqs, *, prefill_tokens=None, return_logits=False):
        from dmc.inference import CompressionStats, ScoreResult

        return [ScoreResult(self.logprobs[s[0]], self.logits[s[0]] if return_logits else None,
                            CompressionStats(len(s), torch.full((1, 1), len(s))),
                            {"kv": len(s), "total": len(s)}) for s in seqs]


def test_unequal_lengths_pool_nll_and_top1_over_tokens():
    """Sequences of unequal lengths: NLL is pooled per scored token (sum of NLLs / tokens, a
    float64 reference), not a mean of per-sequence means, and top1_ci is the token-weighted
    bootstrap interval of the per-sequence agreement, around the pooled agreement."""
    from dmc.eval.stats import mean_interval

    gen = torch.Generator().manual_seed(5)
    lengths = [6, 60, 9, 45, 12, 70, 7]
    sequences = [[i] + [1] * (n - 1) for i, n in enumerate(lengths)]
    # long sequences are harder, and agree with the reference on fewer of their predictions
    logprobs = [-(1 + n / 10) * torch.rand(n - 1, generator=gen, dtype=torch.float64)
                for n in lengths]
    logits = [torch.randn(n, 5, generator=gen) for n in lengths]
    agree = [n - 1 if n < 20 else n // 10 for n in lengths]
    reference = []
    for n, k, scores in zip(lengths, agree, logits):
        ref = torch.log_softmax(scores[:-1].double(), dim=-1)
        ref[k:] = ref[k:].roll(1, dims=-1)  # another argmax from row k on
        reference.append(ref)
    result = evaluate_perplexity(_StubScorer(logprobs, logits), sequences, reference=reference)
    tokens = sum(n - 1 for n in lengths)
    nll = -float(torch.cat(logprobs).sum()) / tokens
    assert result["tokens"] == tokens
    assert result["nll"] == pytest.approx(nll, rel=1e-12)
    assert result["perplexity"] == pytest.approx(math.exp(nll), rel=1e-12)
    counts = [n - 1 for n in lengths]
    per_seq = [-float(lp.sum()) / c for lp, c in zip(logprobs, counts)]
    assert result["per_sequence_nll"] == pytest.approx(per_seq, rel=1e-12)
    low, high = mean_interval(per_seq, counts)
    assert result["perplexity_ci"] == pytest.approx([math.exp(low), math.exp(high)], rel=1e-12)
    top1 = sum(agree) / tokens
    assert result["top1_agreement"] == top1
    assert result["top1_ci"] == list(mean_interval([a / c for a, c in zip(agree, counts)],
                                                   counts))
    assert result["top1_ci"][0] <= top1 <= result["top1_ci"][1]
