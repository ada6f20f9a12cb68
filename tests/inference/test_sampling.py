"""Batched sampling (dmc.inference.sampling.sample_next): its distribution equals filtered_probs,
a row's token is independent of its batch, and tokens are a function of (seed, position)."""
import random

import pytest
import torch

from dmc.inference.sampling import (
    SamplingColumns,
    SamplingParams,
    filtered_probs,
    filtered_scores,
    gumbel_noise,
    gumbel_pick,
    mix64,
    sample_next,
)

pytestmark = pytest.mark.usefixtures("one_thread")

U64 = (1 << 64) - 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(stop_tokens=[3, 1.5]), "stop_tokens must be a sequence of integer token ids"),
    (dict(stop_tokens=5), "stop_tokens must be a sequence of integer token ids"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(top_p=True), "top_p must be a number"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=float("nan")), "top_p must be in"),
    (dict(top_k=-1), "top_k must be >= 0"),
])
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_integral_sampling_params_become_ints():
    params = SamplingParams(max_new_tokens=4.0, top_k=2.0, seed=torch.tensor(7).item(),
                            stop_tokens=[3.0])
    assert (params.max_new_tokens, params.top_k, params.seed, params.stop_tokens) == (4, 2, 7, (3,))
    assert all(type(v) is int for v in (params.max_new_tokens, params.top_k, params.seed))


@pytest.mark.parametrize("temperature", [1e-39, 1e-46, 9e-6])
def test_a_temperature_below_float32_range_samples_greedily(temperature):
    """Logits divided by a float32 temperature that is subnormal or 0 overflow: such a request
    (any temperature under GREEDY_BELOW) is greedy, and draws the argmax in every batch row."""
    params = SamplingParams(temperature=temperature, top_k=3, seed=1)
    assert params.greedy and params.temperature == 0.0
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]] * 4)
    tokens, _ = sample_next(logits, [params] * 4, [0, 1, 2, 3], [0, 1, 2, 3])
    assert tokens == [1, 1, 1, 1]
    assert not SamplingParams(temperature=1e-5).greedy


def mix64_reference(x: int) -> int:
    """splitmix64's finalizer on Python ints (unsigned 64-bit)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def test_mix64_wraps_like_unsigned_64_bit_arithmetic():
    rng = random.Random(0)
    values = [0, 1, 2, 12345, (1 << 63) - 1, 1 << 63, U64, 0x9E3779B97F4A7C15,
              *(rng.getrandbits(64) for _ in range(64))]
    signed = torch.tensor([v - (1 << 64) if v >> 63 else v for v in values])
    assert [g & U64 for g in mix64(signed).tolist()] == [mix64_reference(v) for v in values]
    if torch.cuda.is_available():  # the device wraps the same
        assert torch.equal(mix64(signed.cuda()).cpu(), mix64(signed))


def test_gumbel_noise_is_finite_and_keyed_by_seed_position_and_id():
    ids = torch.arange(1000)[None, :]
    noise = gumbel_noise(torch.tensor([[0], [0], [1], [-1]]), torch.tensor([[0], [1], [0], [0]]),
                         ids.expand(4, -1))
    assert torch.isfinite(noise).all()
    assert all(not torch.equal(noise[i], noise[j]) for i in range(4) for j in range(i))
    again = gumbel_noise(torch.tensor([[1]]), torch.tensor([[0]]), ids.flip(-1))
    torch.testing.assert_close(again[0].flip(-1), noise[2], atol=0, rtol=0)
    # mean and variance of a standard Gumbel: Euler's gamma and pi^2 / 6
    many = gumbel_noise(torch.tensor([[7]]), torch.tensor([[3]]), torch.arange(200_000)[None])
    assert abs(many.mean() - 0.5772) < 0.01 and abs(many.var() - 1.6449) < 0.03


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.8, top_k=4, top_p=0.8),
    dict(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("vocab", [5, 11])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_sampled_frequencies_follow_filtered_probs(vocab, setting, vary):
    draws = 20_000
    logits = 1.5 * torch.randn(vocab, generator=torch.Generator().manual_seed(vocab))
    params = SamplingParams(**setting)
    keys, fixed = list(range(draws)), [11] * draws
    seeds, positions = (keys, fixed) if vary == "seed" else (fixed, keys)
    tokens, _ = sample_next(logits.expand(draws, -1), [params] * draws, seeds, positions)
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / draws
    probs = filtered_probs(logits.double(), params.temperature, params.top_p, params.top_k)
    assert (freq[probs == 0] == 0).all()  # never outside the top-k / top-p set
    stderr = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= 5 * stderr + 1e-12).all(), (freq, probs)


def test_filtered_scores_match_filtered_probs_row_by_row():
    logits = 2 * torch.randn(6, 9, generator=torch.Generator().manual_seed(3))
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3])
    top_k = torch.tensor([0, 3, 0, 9, 1, 4])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 1.0, 0.75])
    scores, ids = filtered_scores(logits, temperature, top_k, top_p)
    probs = torch.zeros_like(logits).scatter_(-1, ids, torch.softmax(scores, dim=-1))
    for row in range(6):
        torch.testing.assert_close(probs[row], filtered_probs(
            logits[row], float(temperature[row]), float(top_p[row]), int(top_k[row])))


@pytest.mark.parametrize("top_p, expected", [(0.5, [1.0, 0.0, 0.0]), (0.75, [2 / 3, 1 / 3, 0.0]),
                                              (0.8, [0.5, 0.25, 0.25])])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_it(top_p, expected):
    """Holtzman et al. (2020), Eq. 2: the nucleus is the smallest set of most likely tokens
    whose mass is >= p. Probabilities 1/2, 1/4, 1/4 (exact in float32) put the mass at the
    boundary: at p = 1/2 the first token alone, at 3/4 the first two."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    want = torch.tensor(expected)
    torch.testing.assert_close(filtered_probs(logits, 1.0, top_p), want)
    scores, ids = filtered_scores(logits[None], torch.ones(1), torch.zeros(1, dtype=torch.long),
                                  torch.tensor([top_p]))
    got = torch.zeros(1, 3).scatter_(-1, ids, torch.softmax(scores, dim=-1))
    torch.testing.assert_close(got[0], want)


def test_a_row_samples_the_same_alone_and_in_any_batch():
    """Also the unsorted path: rows 5 and 7 (no top-k, no top-p) alone skip the sort that the
    batch, holding filtered rows, runs."""
    vocab = 50
    logits = 3 * torch.randn(8, vocab, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in
              [(1.0, 0.9, 0), (0.0, 1.0, 0), (0.7, 1.0, 10), (1.5, 0.5, 0), (0.0, 0.3, 2),
               (1.0, 1.0, 0), (2.0, 0.95, 20), (0.3, 1.0, 0)]]
    seeds, positions = [5, 5, 9, 1 << 70, -3, 0, 42, 7], [0, 3, 3, 17, 2, 1, 100, 8]
    tokens, logps = sample_next(logits, params, seeds, positions)
    for row in range(8):
        alone = sample_next(logits[row:row + 1], params[row:row + 1], seeds[row:row + 1],
                            positions[row:row + 1])
        assert alone == ([tokens[row]], [logps[row]])
    order = [3, 0, 7, 2, 6, 1, 5, 4]
    shuffled, _ = sample_next(logits[order], [params[i] for i in order],
                              [seeds[i] for i in order], [positions[i] for i in order])
    assert shuffled == [tokens[i] for i in order]
    assert [tokens[1], tokens[4]] == logits[[1, 4]].argmax(-1).tolist()  # greedy rows
    torch.testing.assert_close(torch.tensor(logps),
                               torch.log_softmax(logits, -1)[range(8), tokens], atol=1e-6, rtol=0)


def test_tokens_are_a_function_of_seed_and_position():
    vocab, draws = 1000, 64
    logits = torch.zeros(draws, vocab)  # uniform: 64 draws all equal by chance ~ 1000^-63
    params = [SamplingParams(temperature=1.0)] * draws
    base, _ = sample_next(logits, params, [3] * draws, list(range(draws)))
    assert sample_next(logits, params, [3] * draws, list(range(draws)))[0] == base
    assert sample_next(logits, params, [4] * draws, list(range(draws)))[0] != base
    assert len(set(base)) > 1  # positions differ too
    assert sample_next(logits, params, [3 + (1 << 64)] * draws, list(range(draws)))[0] == base


def _many_rows(seed, rows=64, vocab=3000, dtype=torch.bfloat16):
    """Logits, settings and per-row temperatures in (0.05, 2.05) of ``rows`` sampled rows."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    temperatures = (2 * torch.rand(rows, generator=gen) + 0.05).tolist()
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen).tolist()
    seeds[0] = 2**64 - 5  # taken modulo 2^64
    positions = torch.randint(0, 5000, (rows,), generator=gen).tolist()
    settings = SamplingColumns.of([SamplingParams(temperature=t) for t in temperatures], seeds,
                                  positions, torch.device("cpu"))
    return logits, settings


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gumbel_draw_equals_the_pytorch_path(dtype):
    """The Triton Gumbel-max draw (under the interpreter; vocabulary of several blocks) picks
    the PyTorch path's token in every row: the same hash, uniform, noise and tie rule."""
    from dmc.inference.kernels.gumbel import gumbel_argmax

    logits, settings = _many_rows(seed=1 if dtype == torch.float32 else 2, dtype=dtype)
    want = gumbel_pick(logits, settings, filtering=False)
    got = gumbel_argmax(logits, settings.temperature, settings.seed, settings.position)
    assert torch.equal(got, want)
    assert len(set(want.tolist())) > 32


@pytest.mark.gpu
def test_cuda_gumbel_draw_equals_the_cpu_one():
    """On a GPU the kernel (what gumbel_pick runs there without top-k / top-p) draws the CPU's
    PyTorch tokens."""
    logits, settings = _many_rows(seed=3)
    cuda = SamplingColumns(*(column.cuda() for column in settings))
    assert torch.equal(gumbel_pick(logits.cuda(), cuda, filtering=False).cpu(),
                       gumbel_pick(logits, settings, filtering=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_samples_what_the_cpu_samples():
    logits = 3 * torch.randn(16, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=i % 3 * 20) for i in range(16)]
    seeds, positions = list(range(100, 116)), list(range(16))
    assert (sample_next(logits, params, seeds, positions)[0]
            == sample_next(logits.cuda(), params, seeds, positions)[0])
