"""Engine: exact chunked prefill + batched decode with the paged cache against the megatron model's
eval-mode full forward (teacher forcing), real memory savings, sampling, out-of-pages behaviour."""
import argparse
import json

import pytest
import torch

from dmc.inference import (
    Engine,
    SamplingParams,
    load_inference_state,
    save_inference_state,
)
from dmc.inference import cache as cache_module
from dmc.inference.allocation import cache_allocation
from dmc.inference.sampling import filtered_probs
from dmc.megatron.attention import dmc_layers
from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from tiny_models import VOCAB, build_tiny, spread_decisions, tiny_config

MAX_SEQ = 160
PROMPT_LENGTHS = (13, 21, 7)


pytestmark = pytest.mark.usefixtures("one_thread")


def model_config(groups):
    return dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                num_query_groups=groups, vocab_size=VOCAB, max_seq_length=MAX_SEQ)


def build(groups, window="vanilla", c=-1.0, seed=0, omega_offset=0.0):
    return build_tiny(groups, window, c, max_seq=MAX_SEQ, seed=seed, omega_offset=omega_offset)


def prompts(lengths=PROMPT_LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def teacher_forced(model, tokens):
    """Eval-mode full forward: float64 log-probs ``[len, vocab]`` and the DMC layers' kept slots
    ``[layers, kv_heads]`` (None for a vanilla model)."""
    layers = dmc_layers(model)
    for layer in layers:
        layer.reset_cr_stats()
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, device=device)[None]
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1], device=device)[None], None)[0]
    kept = torch.stack([layer.cr_kept for layer in layers]).long().cpu() if layers else None
    return torch.log_softmax(logits.double(), dim=-1).cpu(), kept


def check_against_model(model, results, prompt_list, dmc, delay=0):
    """Each result's tokens and logprobs are the eval-mode forward's; its slots the forward's
    kept slots (DMC; under ``merge_delay`` = ``delay``, Algorithm 1's over the tokens that left
    the raw window plus the window's ``delay + 1``), or none compressed (vanilla)."""
    for prompt, result in zip(prompt_list, results):
        fed = prompt + result.tokens[:-1]  # the last generated token is never fed back
        logp, kept = teacher_forced(model, fed)
        steps = logp[len(prompt) - 1:]
        assert steps.argmax(-1).tolist() == result.tokens
        picked = steps.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), picked,
                                   atol=1e-4, rtol=0)
        assert result.compression.tokens == len(fed)
        if dmc and delay:
            _, merged = teacher_forced(model, fed[:len(fed) - delay - 1])
            assert torch.equal(result.compression.slots, merged + delay + 1)
        elif dmc:
            assert torch.equal(result.compression.slots, kept)  # same decisions, same slots
        else:
            assert result.compression.overall == 1.0


@pytest.mark.parametrize("groups,window,omega_offset", [
    (4, None, 0.0), (4, 3, 0.0), (2, None, 0.0), (2, 3, 0.0), (2, 3, 2**-7), (2, "vanilla", 0.0),
    (4, "vanilla", 0.0),
])
def test_greedy_generation_equals_teacher_forced_model(parallel_1x1, groups, window,
                                                       omega_offset):
    model, runtime = build(groups, window, omega_offset=omega_offset)
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5)
    assert (engine.dmc is None) == (window == "vanilla")
    prompt_list = prompts()
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=32))
    assert [len(r.tokens) for r in results] == [32] * 3
    assert all(r.finish_reason == "length" for r in results)
    if runtime is not None:
        cr = min(r.compression.overall for r in results)
        assert cr > 1.5, "decisions should merge (and across chunk boundaries)"
        if window is not None:  # some segments are longer than the window: it matters
            exact = Engine(model, DMCConfig(window=None, c=runtime.config.c), page_size=4,
                           max_batch=4, chunk_size=5)
            other = exact.generate(prompt_list, SamplingParams(max_new_tokens=32))
            assert any(abs(a - b) > 1e-3 for r, o in zip(results, other)
                       for a, b in zip(r.logprobs, o.logprobs))
    check_against_model(model, results, prompt_list, dmc=runtime is not None)
    assert engine.cache.pages_in_use == 0 and not engine.has_unfinished()
    assert engine.stats.peak_running == 3 and engine.stats.preemptions == 0


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_head_dim_other_than_hidden_over_heads(parallel_1x1, window):
    """``model.kv_channels`` (heads of 24 channels under a 64-wide residual, as the ctx1k preset's
    64 under 128): the pages, the DMC ring and RoPE follow the head dim, not hidden / heads."""
    torch.manual_seed(0)
    config = tiny_config(2, kv_channels=24)
    runtime = None if window == "vanilla" else DMCRuntime(DMCConfig(window=window, c=-1.0))
    model = build_gpt_model(config, VOCAB, MAX_SEQ, dmc=runtime)
    if runtime is not None:
        spread_decisions(model, 0.4)
        runtime.set_mode("eval")
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5)
    assert engine.cache.head_dim == 24
    prompt_list = prompts()
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=16))
    if runtime is not None:
        assert min(r.compression.overall for r in results) > 1.5
    check_against_model(model, results, prompt_list, dmc=runtime is not None)



def test_a_16_bit_models_ring_holds_its_keys_in_its_dtype(parallel_1x1, monkeypatch):
    """A bfloat16 DMC model's window ring is in bfloat16 (half a float32 ring's bytes), and
    serving through it (chunked prefill reads the ring back across chunks, decode merges into
    it) gives the tokens, log-probabilities and slots of a float32 ring bit for bit; the exact
    running mean stays float32."""
    model = build(2, 3)[0].to(torch.bfloat16)
    prompt_list, params = prompts(), SamplingParams(max_new_tokens=12)
    engines = [Engine(model, page_size=4, max_batch=4, chunk_size=5)]
    monkeypatch.setattr(cache_module, "RING_DTYPES", (torch.float32,))
    engines.append(Engine(model, page_size=4, max_batch=4, chunk_size=5))
    assert [e.cache.open_k.dtype for e in engines] == [torch.bfloat16, torch.float32]
    narrow, wide = (e.generate(prompt_list, params) for e in engines)
    assert min(r.compression.overall for r in narrow) > 1.5
    for a, b in zip(narrow, wide):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
        assert torch.equal(a.compression.slots, b.compression.slots)
    monkeypatch.undo()
    exact = Engine(model, DMCConfig(window=None, c=-1.0), page_size=4, max_batch=4)
    assert exact.cache.open_k.dtype == torch.float32

def test_chunk_size_does_not_change_the_result(parallel_1x1):
    model, _ = build(2, 3)
    prompt_list = prompts((40,))
    params = SamplingParams(max_new_tokens=4)
    outs = [Engine(model, page_size=4, max_batch=1, chunk_size=chunk).generate(prompt_list, params)
            for chunk in (1, 7, 64)]
    for other in outs[1:]:
        assert other[0].tokens == outs[0][0].tokens
        assert torch.equal(other[0].compression.slots, outs[0][0].compression.slots)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_engine_uses_eval_semantics_whatever_the_runtime_mode(parallel_1x1, qk_norm):
    if qk_norm:  # the zero-out scaling sits in a pre-hook of the q/k norms: still not here
        torch.manual_seed(0)
        runtime = DMCRuntime(DMCConfig(window=3, c=-1.0))
        model = build_gpt_model(tiny_config(2, qk_layernorm=True), VOCAB, MAX_SEQ, dmc=runtime)
        spread_decisions(model, 0.4)
        runtime.set_mode("eval")
    else:
        model, runtime = build(2, 3)
    prompt_list = prompts((11,))
    params = SamplingParams(max_new_tokens=4)
    expected = Engine(model, page_size=4, max_batch=1, chunk_size=4).generate(prompt_list, params)
    runtime.set_mode("zero_out")
    runtime.zero_out_scale = 0.3  # must not scale the decision channels inside the engine
    got = Engine(model, page_size=4, max_batch=1, chunk_size=4).generate(prompt_list, params)
    assert got[0].tokens == expected[0].tokens and got[0].logprobs == expected[0].logprobs
    assert torch.equal(got[0].compression.slots, expected[0].compression.slots)


@pytest.mark.parametrize("window", [3, "vanilla"])
def test_triton_kernels_in_the_engine(parallel_1x1, window):
    """DMC (decisions read by the decode RoPE and write kernels) and vanilla (keys and queries
    rotated, keys and values stored, by one kernel a layer) decode as with the PyTorch
    kernels."""
    model, _ = build(2, window)
    prompt_list = prompts((9, 5))
    params = SamplingParams(max_new_tokens=3)
    reference = Engine(model, page_size=4, max_batch=2, chunk_size=4).generate(prompt_list, params)
    triton = Engine(model, page_size=4, max_batch=2, chunk_size=4, use_triton=True)
    for a, b in zip(reference, triton.generate(prompt_list, params)):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)


def test_pages_in_use_follow_the_measured_cr(parallel_1x1):
    """Real memory: pages held by a DMC sequence are within 10% of vanilla pages / measured CR."""
    prompt_list = prompts((100, 120, 90), seed=2)
    params = SamplingParams(max_new_tokens=16)
    dmc_model, _ = build(2, 3)
    vanilla_model, _ = build(2)
    dmc_results = Engine(dmc_model, page_size=4, max_batch=3).generate(prompt_list, params)
    vanilla_results = Engine(vanilla_model, page_size=4, max_batch=3).generate(prompt_list, params)
    for d, v in zip(dmc_results, vanilla_results):
        tokens = len(d.prompt) + 15
        assert v.kv_pages == 2 * 2 * -(-tokens // 4)  # layers x heads x ceil(tokens / page)
        cr = d.compression.overall
        assert cr > 1.5
        assert abs(d.kv_pages - v.kv_pages / cr) <= 0.1 * v.kv_pages / cr
        assert d.kv_bytes == d.kv_pages * 2 * 4 * 16 * 4  # K+V, page 4, head_dim 16, float32


def test_sampling_is_reproducible_and_tiny_top_p_is_greedy(parallel_1x1):
    model, _ = build(2, 3)
    prompt_list = prompts()

    def run(**kw):
        engine = Engine(model, page_size=4, max_batch=3, chunk_size=8)
        return [r.tokens for r in engine.generate(prompt_list, SamplingParams(max_new_tokens=12,
                                                                             **kw))]

    sampled = run(temperature=1.0, top_p=0.9, seed=7)
    assert sampled == run(temperature=1.0, top_p=0.9, seed=7)
    assert sampled != run(temperature=1.0, top_p=0.9, seed=8)
    assert run(temperature=1.0, top_p=1e-6, seed=3) == run()

    # a request without a seed draws with the engine's seed + its request id: two of them with
    # one prompt differ, and each equals the request given that seed
    engine = Engine(model, page_size=4, max_batch=3, chunk_size=8, seed=11)
    twice = [r.tokens for r in engine.generate(prompt_list[:1] * 2, SamplingParams(
        max_new_tokens=12, temperature=1.0))]
    assert twice[0] != twice[1]
    assert twice == [run(temperature=1.0, seed=11 + i)[0] for i in (0, 1)]

    # reproducible whatever the batch: a request alone samples what it sampled in the batch
    alone = Engine(model, page_size=4, max_batch=1).generate(
        prompt_list[1:2], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7))
    assert alone[0].tokens == sampled[1]


def test_filtered_probs_top_p_and_top_k():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    torch.testing.assert_close(filtered_probs(logits, 1.0, top_p=0.7),
                               torch.tensor([0.0, 0.5, 0.3, 0.0]) / 0.8)
    torch.testing.assert_close(filtered_probs(logits, 1.0, top_p=0.85),
                               torch.tensor([0.0, 0.5, 0.3, 0.15]) / 0.95)
    torch.testing.assert_close(filtered_probs(logits, 1.0, top_p=1e-9),
                               torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(filtered_probs(logits, 1.0, top_k=3),
                               torch.tensor([0.0, 0.5, 0.3, 0.15]) / 0.95)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_stop_tokens_finish_sequences_independently(parallel_1x1):
    model, _ = build(2, None)
    prompt_list = prompts()
    engine = Engine(model, page_size=4, max_batch=3)
    free = engine.generate(prompt_list, SamplingParams(max_new_tokens=20))
    stop = free[0].tokens[4]  # request 0 stops at its 5th token (or earlier)
    never = next(t for t in range(VOCAB) if all(t not in f.tokens for f in free))
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=20,
                                                          stop_tokens=(never, stop)))
    for f, r in zip(free, results):
        cut = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
        assert r.tokens == f.tokens[:cut]
        assert r.finish_reason == ("stop" if stop in f.tokens else "length")
    assert results[0].finish_reason == "stop" and len(results[0].tokens) <= 5
    assert engine.cache.pages_in_use == 0


@pytest.mark.parametrize("window,temperature,pages", [("vanilla", 0.0, 60), (3, 1.0, 36)])
def test_out_of_pages_preempts_the_youngest_and_restarts_it(parallel_1x1, window, temperature,
                                                            pages):
    model, _ = build(2, window)
    # 2 layers x 2 heads x ceil(35 / 4) = 36 pages for one full vanilla sequence, about half
    # that under DMC at CR ~2: the three sequences do not fit together
    check_preemption(model, "auto", prompts((10, 12, 9)), pages, temperature)


def check_preemption(model, dmc, prompt_list, pages, temperature=1.0):
    """Three requests in a pool of ``pages``: some are preempted (never the oldest) and restart
    with the output (tokens, logprobs) of an engine with room for all; every page returns."""
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5)
    expected = Engine(model, dmc, page_size=4, max_batch=3, chunk_size=8).generate(
        prompt_list, [params] * 3)
    tight = Engine(model, dmc, page_size=4, max_batch=3, chunk_size=8, num_pages=pages)
    results = tight.generate(prompt_list, [params] * 3)
    assert tight.stats.preemptions > 0
    assert results[0].preemptions == 0  # the oldest request is never the one preempted
    for e, r in zip(expected, results):
        assert r.tokens == e.tokens
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(e.logprobs),
                                   atol=1e-5, rtol=0)
    assert tight.cache.pages_in_use == 0 and tight.cache.free_pages == pages


def test_a_sequence_larger_than_the_pool_fails_alone(parallel_1x1):
    model, _ = build(2)
    engine = Engine(model, page_size=4, max_batch=3, num_pages=12)  # 3 pages per head
    alone = engine.generate([list(range(6))], SamplingParams(max_new_tokens=4))
    prompts = [list(range(20)), list(range(6)), list(range(10))]
    params = [SamplingParams(max_new_tokens=n) for n in (2, 4, 8)]
    too_long, ok, outgrown = engine.generate(prompts, params)
    assert (too_long.finish_reason, too_long.tokens) == ("cache_full", [])
    assert "20 tokens do not fit in the whole pool" in too_long.error
    assert ok.finish_reason == "length" and ok.tokens == alone[0].tokens and ok.error is None
    assert outgrown.finish_reason == "cache_full" and 0 < len(outgrown.tokens) < 8
    assert "alone needs more than the whole pool" in outgrown.error
    assert engine.cache.pages_in_use == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request(list(range(150)), SamplingParams(max_new_tokens=20))


def test_prefill_through_the_triton_window_kernels(parallel_1x1):
    """``dmc.accumulate_backend="triton"`` (the interpreter on the CPU): the engine's prefill
    compresses its chunks through the fused kernels and generates what the eval-mode model does,
    prompts longer than one chunk included (the open slot's prefix goes through them too)."""
    import dataclasses

    model, runtime = build(2, 3)
    config = dataclasses.replace(runtime.config, accumulate_backend="triton")
    prompt_list = prompts((13, 21))
    results = Engine(model, config, page_size=4, max_batch=2, chunk_size=8).generate(
        prompt_list, SamplingParams(max_new_tokens=6))
    check_against_model(model, results, prompt_list, config)


def test_from_state_dict_file_and_cli(parallel_1x1, tmp_path, capsys):
    from dmc.inference.generate_cli import (
        EXIT_REQUEST_FAILED,
        add_generate_arguments,
        run_generate,
    )

    model, runtime = build(2, 3)
    path = tmp_path / "model.pt"
    save_inference_state(path, model, model_config(2), runtime.config)
    saved = load_inference_state(path)
    assert saved["dmc_config"]["window"] == 3 and saved["model_config"]["num_query_groups"] == 2
    prompt_list = prompts((9, 6))
    params = SamplingParams(max_new_tokens=6)
    direct = Engine(model, page_size=4, max_batch=2).generate(prompt_list, params)
    loaded = Engine.from_file(path, page_size=4, max_batch=2)
    assert loaded.dmc == runtime.config
    assert [r.tokens for r in loaded.generate(prompt_list, params)] == [r.tokens for r in direct]

    parser = add_generate_arguments(argparse.ArgumentParser())
    args_list = ["--state-dict", path, "--prompt-ids", " ".join(map(str, prompt_list[0])),
                 "--prompt-ids", ",".join(map(str, prompt_list[1])), "--max-new-tokens", "6",
                 "--page-size", "4", "--json"]
    args = parser.parse_args(list(map(str, args_list)))
    assert run_generate(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in out["results"]] == [r.tokens for r in direct]
    assert run_generate(parser.parse_args([*map(str, args_list), "--cuda-graphs"])) == 0
    graphs = json.loads(capsys.readouterr().out)  # the static step (eager on the CPU)
    assert [r["tokens"] for r in graphs["results"]] == [r.tokens for r in direct]
    assert run_generate(parser.parse_args([*map(str, args_list), "--cuda-graphs",
                                           "--overlap"])) == 0
    overlapped = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in overlapped["results"]] == [r.tokens for r in direct]
    assert 0 < overlapped["stats"]["continued_steps"] < overlapped["stats"]["decode_steps"]
    plain_args = [a for a in map(str, args_list) if a != "--json"]
    assert run_generate(parser.parse_args([*plain_args, "--cuda-graphs", "--overlap"])) == 0
    assert "decode steps overlapped" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(ValueError, match="--overlap needs --cuda-graphs"):
        run_generate(parser.parse_args([*map(str, args_list), "--overlap"]))
    assert run_generate(parser.parse_args([*plain_args, "--stream"])) == 0
    streamed = [line.split(" ", 1) for line in capsys.readouterr().out.splitlines()
                if line.startswith("[") and "prompt +" not in line][:12]  # '[i] ID' lines
    for i, result in enumerate(direct):  # one id a line (two in a request's first)
        ids = " ".join(text for index, text in streamed if index == f"[{i}]").split()
        assert list(map(int, ids)) == result.tokens
    with pytest.raises(ValueError, match="--stream .* --json"):
        run_generate(parser.parse_args([*map(str, args_list), "--stream"]))
    assert out["results"][0]["compression"]["cr"] == pytest.approx(direct[0].compression.overall)
    with pytest.raises(ValueError, match="--tokenizer"):
        run_generate(parser.parse_args(["--state-dict", str(path), "--prompt", "hello"]))
    long_prompt = " ".join(map(str, (prompt_list[0] * 3)[:20]))
    args = parser.parse_args([
        "--state-dict", str(path), "--prompt-ids", long_prompt, "--prompt-ids",
        " ".join(map(str, prompt_list[1])), "--max-new-tokens", "6", "--page-size", "4",
        "--num-pages", "12", "--json"])
    assert run_generate(args) == EXIT_REQUEST_FAILED  # 20 tokens: up to 20 pages
    failed, done = json.loads(capsys.readouterr().out)["results"]
    assert failed["finish_reason"] == "cache_full" and "whole pool" in failed["error"]
    assert done["tokens"] == direct[1].tokens and done["error"] is None
    limit = loaded.model.max_sequence_length
    with pytest.raises(ValueError, match=f"exceed the model's max_seq_length \\({limit}\\)"):
        run_generate(parser.parse_args(["--state-dict", str(path), "--prompt-ids", "1 2 3",
                                        "--max-new-tokens", str(limit)]))
    vocab = loaded.model.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the model's vocabulary"):
        run_generate(parser.parse_args(["--state-dict", str(path), "--prompt-ids", f"1 {vocab}"]))
    one = ["--state-dict", str(path), "--prompt-ids", "1 2", "--max-new-tokens", "2"]
    with pytest.raises(ValueError, match="--stop-token: token id -5 is outside"):
        run_generate(parser.parse_args([*one, "--stop-token", "-5"]))
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        run_generate(parser.parse_args([*one, "--temperature", "nan"]))
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        run_generate(parser.parse_args([*one, "--num-pages", "0"]))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="notes.txt: not a dmc inference state"):
        run_generate(parser.parse_args(["--state-dict", str(tmp_path / "notes.txt"),
                                        "--prompt-ids", "1"]))
    newer = tmp_path / "newer.pt"
    torch.save(dict(torch.load(path, weights_only=True), format=2), newer)
    with pytest.raises(ValueError, match="newer.pt: inference state format 2; this dmc reads "
                                         "format 1"):
        run_generate(parser.parse_args(["--state-dict", str(newer), "--prompt-ids", "1"]))


@pytest.mark.parametrize("ids, message", [
    ("1 2 abc", "--prompt-ids '1 2 abc': expected integer token ids separated by spaces or "
                "commas"),
    ("1,2.5", "--prompt-ids '1,2.5': expected integer token ids"),
    (" ", "--prompt-ids ' ': no token ids"),
])
def test_bad_prompt_ids_exit_2_naming_the_flag(tmp_path, capsys, ids, message):
    from dmc.cli import main

    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt-ids", ids]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk_size=0), "chunk_size must be >= 1, got 0"),
    (dict(max_batch=-1), "max_batch must be >= 1, got -1"),
    (dict(page_size=0), "page_size must be >= 1, got 0"),
    (dict(max_seq_len=0), "max_seq_len must be None or >= 1"),
    (dict(step_tokens=0), "step_tokens must be None or >= 1"),
    (dict(cache_dtype=torch.int8), "cache_dtype must be one of"),
    (dict(num_pages=0), "num_pages must be >= 1"),
    (dict(policy="h2o"), "policy must be a dmc.policies.KVPolicy"),
])
def test_bad_engine_arguments_name_the_field(parallel_1x1, kwargs, message):
    model, _ = build(2)
    with pytest.raises(ValueError, match=message):
        Engine(model, dmc=None, **{"max_batch": 2, **kwargs})


def test_files_without_newer_dmc_fields_load_with_the_paper_defaults(parallel_1x1, tmp_path):
    model, runtime = build(2, 3)
    old_fields = {"window": 3, "tau": 0.1, "c": -1.0, "hard": False}  # before omega_offset
    save_inference_state(tmp_path / "old.pt", model, model_config(2), old_fields)
    loaded = Engine.from_file(tmp_path / "old.pt", page_size=4, max_batch=1)
    assert loaded.dmc == runtime.config
    assert loaded.dmc.omega_offset == 0.0 and loaded.dmc.prior == "global"


# what a float32 cache of build(2) allocates (cache_allocation's shape, but pages and slots)
CACHE_SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32,
                   max_seq_len=MAX_SEQ)


def test_default_pool_respects_the_byte_budget(parallel_1x1):
    """kv_cache_bytes holds everything the cache allocates (cache_allocation, equal to the
    bytes allocated: tests/benchmarks/test_decode_throughput.py): the pool is the most pages
    that fit beside the block tables, lengths and merge state of the max_batch slots."""
    model, _ = build(2)
    budget = cache_allocation(num_pages=10, max_seqs=4, window=None, **CACHE_SHAPE)["total"]
    assert Engine(model, dmc=None, max_batch=4, kv_cache_bytes=budget).cache.num_pages == 10
    assert Engine(model, dmc=None, max_batch=4, kv_cache_bytes=budget - 1).cache.num_pages == 9
    page = 2 * 16 * 16 * 4 + 4  # keys + values of 16 slots of head_dim 16, a free-list id
    tables = 4 * 2 * 2 * (MAX_SEQ // 16 * 4 + 4)  # slots x layers x kv x (page ids, length)
    assert budget > 10 * page + tables
    merging, runtime = build(2, 3)  # DMC, window 3: the merge rings of 4 slots count too
    rings = 4 * 2 * 2 * (3 * (2 * 16 * 4 + 4) + 4)  # slots x layers x kv x open-slot state
    budget = cache_allocation(num_pages=10, max_seqs=4, window=3, **CACHE_SHAPE)["total"]
    engine = Engine(merging, max_batch=4, kv_cache_bytes=budget + page - 1)
    state = (engine.cache.open_k, engine.cache.open_v, engine.cache.open_omega,
             engine.cache.open_count)
    assert engine.cache.num_pages == 10 and sum(t.nbytes for t in state) == rings
    roomy = Engine(model, dmc=None, max_batch=4, kv_cache_bytes=1 << 40)
    assert roomy.cache.num_pages == 4 * (MAX_SEQ // 16) * 2 * 2  # uncompressed, all layers/heads
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(model, dmc=None, kv_cache_bytes=100)


@pytest.mark.parametrize("window,policy", [(3, None), ("vanilla", None), ("vanilla", "h2o")])
def test_score_batch_equals_scoring_one_at_a_time(parallel_1x1, window, policy):
    """Different lengths and prefill lengths in one batch give each sequence's own scores,
    compression and bytes; every page is back in the pool afterwards. The second batch has a
    gap: the shortest sequence ends (token 19) before the others' prefills do (25 and 35), so
    no sequence decodes at positions 19-24 (the batch used to stop there, leaving the others'
    teacher-forced tokens unscored)."""
    from dmc.policies import get_policy

    model, _ = build(2, window)
    sequences = prompts((30, 41, 19), seed=3)

    def engine(batch):
        return Engine(model, page_size=4, max_batch=batch, chunk_size=8,
                      policy=get_policy(policy, compression_ratio=2.0) if policy else None)

    single = engine(1)
    for prefill in ([12, 30, 5], [25, 35, 5]):
        batched = engine(3).score_batch(sequences, prefill_tokens=prefill, return_logits=True)
        for tokens, p, got in zip(sequences, prefill, batched):
            want = single.score(tokens, prefill_tokens=p, return_logits=True)
            assert got.token_logprobs.shape == (len(tokens) - 1,)
            assert got.logits.shape[0] == len(tokens)
            torch.testing.assert_close(got.token_logprobs, want.token_logprobs, atol=1e-5,
                                       rtol=0)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
            assert torch.equal(got.compression.slots, want.compression.slots)
            assert got.cache_bytes == want.cache_bytes and got.cache_bytes["total"] > 0
    with pytest.raises(ValueError, match="max_batch"):
        single.score_batch(sequences)
    assert single.cache.pages_in_use == 0
