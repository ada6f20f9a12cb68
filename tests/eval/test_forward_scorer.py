"""ForwardScorer (the eval-mode forward as a scorer) equals the engine's compressed cache on a
vanilla, a DMC and a delayed-merging DMC model (chunked prefill, then teacher-forced decode):
log-probabilities, logits, slots and cache bytes; under delayed merging the slots are Algorithm
1's over the tokens a query no longer sees raw plus the raw window, and `dmc eval compare`
scores such a model through the engine."""
import json

import pytest
import torch

from dmc.cli import main
from dmc.eval.forward_scorer import ForwardScorer
from dmc.inference import Engine, save_inference_state
from dmc.inference.loading import load_model
from tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96,
          "vocab_size": VOCAB, "max_seq_length": 160, "num_query_groups": 2}


@pytest.fixture(scope="module")
def models(parallel_1x1, tmp_path_factory):
    root = tmp_path_factory.mktemp("forward")
    vanilla, _ = build_tiny(2, seed=3)
    save_inference_state(root / "vanilla.pt", vanilla, CONFIG)
    for name, dmc in (("dmc", {"window": 3, "c": -1.0}),
                      ("delayed", {"window": 3, "c": -1.0, "merge_delay": 5})):
        model, _ = build_tiny(2, window=3, c=-1.0, seed=3)
        save_inference_state(root / f"{name}.pt", model, CONFIG, dmc)
    stream = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    torch.save(stream, root / "tokens.pt")
    return root


def _sequences(lengths=(57, 33, 80)):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("chunk", [16, 5])
@pytest.mark.parametrize("name", ["vanilla", "dmc", "delayed"])
def test_forward_equals_the_engine(models, name, chunk):
    loaded = load_model(models / f"{name}.pt")
    engine = Engine(loaded.model, dmc=None if name == "vanilla" else "auto", max_batch=3,
                    max_seq_len=96, page_size=8, chunk_size=chunk)
    sequences = _sequences()
    want = engine.score_batch(sequences, prefill_tokens=20, return_logits=True)
    got = ForwardScorer(loaded, max_batch=3, page_size=8).score_batch(
        sequences, prefill_tokens=20, return_logits=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.token_logprobs, w.token_logprobs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g.logits, w.logits, rtol=1e-4, atol=1e-4)
        assert g.compression.tokens == w.compression.tokens
        assert torch.equal(g.compression.slots, w.compression.slots.long())
        for key in ("kv", "metadata", "dmc_state", "total"):
            assert g.cache_bytes[key] == w.cache_bytes[key], key
    if name != "vanilla":
        assert any((r.compression.slots < r.compression.tokens).any() for r in got)


@pytest.mark.parametrize("name", ["dmc", "delayed"])
def test_bf16_cache_bytes_equal_the_engine(models, name):
    """A bf16 DMC model's merge ring is bf16 in the engine (float32 under delayed merging): the
    bytes reported must be those the engine's cache holds."""
    loaded = load_model(models / f"{name}.pt")
    loaded.model.to(torch.bfloat16)
    engine = Engine(loaded.model, dmc="auto", max_batch=2, max_seq_len=96, page_size=8,
                    chunk_size=16)
    sequences = _sequences((57, 33))
    want = engine.score_batch(sequences, prefill_tokens=20)
    got = ForwardScorer(loaded, max_batch=2, page_size=8).score_batch(sequences,
                                                                       prefill_tokens=20)
    for g, w in zip(got, want):
        assert torch.equal(g.compression.slots, w.compression.slots.long())
        assert {k: g.cache_bytes[k] for k in w.cache_bytes} == w.cache_bytes


def test_delayed_merge_slots(models):
    loaded = load_model(models / "delayed.pt")
    tokens = _sequences((57,))[0]
    result = ForwardScorer(loaded).score_batch([tokens])[0]
    plain = ForwardScorer(load_model(models / "dmc.pt")).score_batch([tokens[:51]])[0]
    # layer 0 decides from the embeddings alone, so both models decide alike there
    assert torch.equal(result.compression.slots[0], plain.compression.slots[0] + 6)
    assert result.compression.tokens == 57
    short = ForwardScorer(loaded).score_batch([tokens[:4]])[0]
    assert torch.equal(short.compression.slots, torch.full((2, 2), 4))


def test_compare_scores_a_delayed_merge_model(models, capsys):
    assert main(["eval", "compare", "--control", str(models / "vanilla.pt"), "--dmc",
                 str(models / "dmc.pt"), str(models / "delayed.pt"), "--data",
                 str(models / "tokens.pt"), "--seq-len", "48", "--num-sequences", "2",
                 "--needle-lengths", "40", "--needle-depths", "0.5", "--needles-per-cell", "2",
                 "--batch-size", "2", "--prefill-fraction", "0.5", "--policies", "",
                 "--output", str(models / "out"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["label"] for r in rows] == ["control", "DMC", "DMC delay 5"]
    assert rows[2]["slots_cr"] < rows[1]["slots_cr"]  # the raw window costs slots
    assert 0 <= rows[2]["needle_accuracy"] <= 1 and rows[2]["perplexity"] > 1


@pytest.mark.parametrize("mode,training", [("train", True), ("zero_out", False)])
def test_scoring_restores_the_runtime_mode_and_training_flag(models, mode, training):
    """Scoring runs the forward in eval mode with hard decisions, then hands the model back as
    it came: the DMC runtime's mode and ``model.training`` restored (a training loop that
    evaluates between steps keeps training with soft decisions)."""
    from dmc.megatron.attention import dmc_layers

    loaded = load_model(models / "dmc.pt")
    runtime = dmc_layers(loaded.model)[0].dmc
    runtime.set_mode(mode)
    loaded.model.train(training)
    scorer = ForwardScorer(loaded, max_batch=1)
    seen, forward = [], scorer._forward

    def spy(tokens):
        seen.append((runtime.mode, loaded.model.training))
        return forward(tokens)

    scorer._forward = spy
    scorer.score_batch(_sequences((20,)))
    assert seen and set(seen) == {("eval", False)}
    assert (runtime.mode, loaded.model.training) == (mode, training)


def test_delayed_merge_bytes_when_merged_slots_fill_whole_pages(models):
    """Under merge_delay d = 5 the pages hold slots - (d + 1) merged slots per (layer, head):
    14, 22, 6, 9 slots -> 8, 16, 0, 3 merged -> 1 + 2 + 0 + 1 pages of 8 (counted by hand)."""
    scorer = ForwardScorer(load_model(models / "delayed.pt"), page_size=8)
    got = scorer._bytes(torch.tensor([[14, 22], [6, 9]]))
    head_dim, heads, pages = 16, 4, 4  # hidden 64 / 4 query heads; 2 layers x 2 KV heads
    open_slot = 3 * (2 * head_dim * 4 + 4) + 4  # window 3: keys, values, omegas; the count
    ring = 6 * (2 * head_dim * 4 + 2 * 4)  # d + 1 raw keys and values, their alpha and omega
    assert got == {"kv": pages * 8 * 2 * head_dim * 4, "metadata": pages * 4 + heads * 4,
                   "dmc_state": heads * (open_slot + ring), "policy_state": 0, "host": 0,
                   "total": pages * 8 * 2 * head_dim * 4 + pages * 4 + heads * 4
                   + heads * (open_slot + ring)}


@pytest.mark.parametrize("prefill", [0, -1, 21])
def test_prefill_tokens_out_of_range_are_refused_like_the_engine(models, prefill):
    """prefill_tokens must be None or in [1, n] (as Engine.score_batch checks it)."""
    loaded = load_model(models / "vanilla.pt")
    tokens = _sequences((20,))
    message = r"prefill_tokens must be None or in \[1, 20\]"
    with pytest.raises(ValueError, match=message):
        ForwardScorer(loaded, max_batch=1).score_batch(tokens, prefill_tokens=prefill)
    with pytest.raises(ValueError, match=message):
        Engine(loaded.model, max_batch=1, max_seq_len=32, page_size=8).score_batch(
            tokens, prefill_tokens=prefill)
