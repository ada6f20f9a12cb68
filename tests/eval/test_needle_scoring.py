"""Needle scoring through the engine: exact match = greedy generation, counts per depth."""
import pytest
import torch

from dmc.data.needle import make_needle_examples
from dmc.eval.needle import evaluate_needle
from dmc.inference import Engine, SamplingParams
from dmc.inference import CompressionStats, ScoreResult
from tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def examples(n=4, seq_len=48):
    stream = torch.randint(0, VOCAB, (3000,), generator=torch.Generator().manual_seed(5))
    return make_needle_examples(stream.tolist(), seq_len, n, key_len=4, value_len=3, seed=2)


class ScriptedEngine:
    """Scores by a script: the answer's first ``right[i]`` tokens of example ``i`` get the top
    logit, the rest a wrong one; it records the prefill lengths it was asked for."""

    max_batch = 3

    def __init__(self, right):
        self.right, self.calls = list(right), []

    def score_batch(self, sequences, *, prefill_tokens=None, return_logits=False):
        return [self.score(tokens, prefill_tokens=p) for tokens, p in zip(sequences,
                                                                            prefill_tokens)]

    def score(self, tokens, *, prefill_tokens=None):
        self.calls.append(prefill_tokens)
        ok = self.right[len(self.calls) - 1]
        n = len(tokens)
        logits = torch.zeros(n, VOCAB)
        start = prefill_tokens - 1
        for j, row in enumerate(range(start, n - 1)):
            target = tokens[row + 1] if j < ok else (tokens[row + 1] + 1) % VOCAB
            logits[row, target] = 5.0
        logp = torch.log_softmax(logits, -1)[torch.arange(n - 1), torch.tensor(tokens[1:])]
        return ScoreResult(logp.double(), logits, CompressionStats(n, torch.full((1, 1), n)),
                           {"kv": 8 * n, "total": 8 * n})


def test_accuracy_counts_exact_and_token_hits():
    exs = examples(4)
    engine = ScriptedEngine([3, 0, 2, 3])
    result = evaluate_needle(engine, exs)
    assert engine.calls == [ex.prompt_len for ex in exs]  # prompt prefilled, answer decoded
    assert result["accuracy"] == 0.5 and result["token_accuracy"] == pytest.approx(8 / 12)
    assert {d: v["accuracy"] for d, v in result["per_depth"].items()} == {
        "0.1": 1.0, "0.3": 0.0, "0.5": 0.0, "0.7": 1.0}
    assert result["per_length"] == {48: {"accuracy": 0.5, "accuracy_ci": result["accuracy_ci"],
                                         "examples": 4}}
    low, high = result["accuracy_ci"]
    assert low == pytest.approx(0.1500, abs=1e-4) and high == pytest.approx(0.8500, abs=1e-4)
    assert result["compression"]["cr"] == 1.0
    assert result["cache_bytes"] == {"kv": 8 * 4 * 48, "total": 8 * 4 * 48}


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_exact_match_is_greedy_generation(parallel_1x1, window):
    model, _ = build_tiny(2, window, seed=4)
    exs = examples(4)
    engine = Engine(model, max_batch=1, max_seq_len=48)
    result = evaluate_needle(engine, exs)
    for ex in exs:
        generated = engine.generate([ex.prompt], SamplingParams(max_new_tokens=3))[0].tokens
        scored = engine.score(ex.tokens, prefill_tokens=ex.prompt_len, return_logits=True)
        assert generated[0] == int(scored.logits[ex.prompt_len - 1].argmax())
        own = engine.score(ex.prompt + generated, prefill_tokens=ex.prompt_len,
                           return_logits=True)  # greedy tokens are the argmax given themselves
        assert own.logits[ex.prompt_len - 1:-1].argmax(-1).tolist() == generated
    nll = 0.0
    for ex in exs:
        full = engine.score(ex.tokens)  # all prefilled: DMC and vanilla give the same numbers
        nll -= float(full.token_logprobs[ex.prompt_len - 1:].sum())
    assert result["answer_nll"] == pytest.approx(nll / 12, rel=1e-5)


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_a_batch_of_two_lengths_scores_like_one_example_at_a_time(parallel_1x1, window):
    """A batch holding the last needles of one length and the first of a longer one (as
    ``dmc eval compare`` batches them, length after length): each example's answer is scored
    as alone. The engine's batch used to stop when the short examples ended, so the long ones'
    answers were read off their last prompt position and counted as misses."""
    model, _ = build_tiny(2, window, seed=4)
    exs = examples(2, seq_len=24) + examples(2, seq_len=64)
    batched = evaluate_needle(Engine(model, max_batch=4, max_seq_len=64), exs)
    alone = Engine(model, max_batch=1, max_seq_len=64)
    per_example = [evaluate_needle(alone, [ex]) for ex in exs]
    assert batched["token_accuracy"] == pytest.approx(
        sum(r["token_accuracy"] for r in per_example) / len(exs))
    assert batched["accuracy"] == pytest.approx(
        sum(r["accuracy"] for r in per_example) / len(exs))
    assert batched["answer_nll"] == pytest.approx(
        sum(r["answer_nll"] for r in per_example) / len(exs), rel=1e-5)
