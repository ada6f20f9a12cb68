"""The engine under DMS (delayed eviction, hard decisions) against an ops-level eval-mode DMS
forward of the same megatron model (decisions from the borrowed query channel,
:func:`dmc.ops.split_dms_channels`; megatron's RoPE; attention in float64 under the
delayed-eviction mask, :func:`dmc.ops.dmc_attention` with ``delay = w``) and against the
``DMSSelfAttention`` model in ``eval`` mode: teacher-forced scores (chunked prefill in several
chunk sizes, then batched decode of sequences of different lengths) and greedy generation, MHA
and GQA; pages hold survivors only."""
import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from dmc.inference import Engine, SamplingParams
from dmc.inference.allocation import cache_allocation
from dmc.inference.paging import pages_for
from dmc.megatron.config import DMCConfig
from dmc.megatron.dms_attention import DMSSelfAttention
from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCRuntime
from dmc.ops import dmc_attention, log_keep_next, split_dms_channels, zero_dms_channel
from test_engine import CACHE_SHAPE, check_preemption, teacher_forced
from tiny_models import VOCAB, build_tiny, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_SEQ = 160


def dms(window, c=0.0):
    return DMCConfig(method="dms", dms_window=window, c=c)


def build(groups, seed=0):
    """A tiny vanilla Llama: DMS borrows a query channel, so it needs no other weights."""
    return build_tiny(groups, max_seq=MAX_SEQ, seed=seed)[0]


def build_dms(groups, window, c=0.0, seed=0):
    """A tiny model with ``DMSSelfAttention`` layers in ``eval`` mode (hard decisions)."""
    torch.manual_seed(seed)
    runtime = DMCRuntime(dms(window, c))
    model = build_gpt_model(tiny_config(groups), VOCAB, MAX_SEQ, dmc=runtime)
    runtime.set_mode("eval")
    return model


def sequences(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]


def _dms_layer(layer, x, freqs, config):
    """One layer of the eval-mode DMS forward; returns ``(x, alpha [kv, n])``."""
    attn = layer.self_attention
    query, key, value = attn.get_query_key_value_tensors(layer.input_layernorm(x))
    kv, n = key.shape[2], x.shape[0]
    channels = split_dms_channels(query.permute(1, 2, 0, 3), kv, config.c,
                                  config.dms_logit_scale)
    alpha = (channels.alpha_logit > 0).double()
    alpha[..., 0] = 0
    query = apply_rotary_pos_emb(channels.query.permute(2, 0, 1, 3), freqs, config=attn.config)
    key = apply_rotary_pos_emb(key, freqs, config=attn.config)
    query = zero_dms_channel(query.permute(1, 2, 0, 3), kv)
    scale = attn.config.softmax_scale or query.shape[-1] ** -0.5
    context = dmc_attention(query.double(), key.permute(1, 2, 0, 3).double(),
                            value.permute(1, 2, 0, 3).double(), log_keep_next(alpha),
                            scale=scale, backend="dense", delay=config.dms_window)
    out, bias = attn.linear_proj(context.permute(2, 0, 1, 3).reshape(n, 1, -1).to(x.dtype))
    x = x + out if bias is None else x + out + bias
    out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
    return (x + out if bias is None else x + out + bias), alpha[0]


def reference(model, tokens, config):
    """Float64 log-probs ``[n, vocab]`` of the eval-mode DMS forward (the model's attention
    modules only provide their QKV and output projections) and the slots a query holds after
    the ``n`` tokens per (layer, KV head): survivors of the window plus ``min(n, w + 1)``, and
    how many of the window's keys are marked for eviction ``[layers, kv_heads]``."""
    device = next(model.parameters()).device
    n, w = len(tokens), config.dms_window
    with torch.no_grad():
        x = model.embedding(input_ids=torch.tensor(tokens, device=device)[None],
                            position_ids=torch.arange(n, device=device)[None])
        freqs = model.rotary_pos_emb(n)
        held, marked = [], []
        for layer in model.decoder.layers:
            x, alpha = _dms_layer(layer, x, freqs, config)
            left = max(n - w - 1, 0)
            held.append((alpha[:, 1:left + 1] == 0).sum(-1).cpu() + min(n, w + 1))
            marked.append(alpha[:, left + 1:].sum(-1).cpu())
        weight = (model.shared_embedding_or_output_weight()
                  if model.share_embeddings_and_output_weights else None)
        logits, _ = model.output_layer(model.decoder.final_layernorm(x), weight=weight)
    return (torch.log_softmax(logits[:, 0].double(), -1).cpu(), torch.stack(held).long(),
            torch.stack(marked).long())


@pytest.mark.parametrize("groups,window", [(4, 3), (2, 3), (2, 0), (2, 9)])
@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_teacher_forced_scores_equal_the_eval_mode_forward(parallel_1x1, groups, window, chunk):
    """score_batch: each sequence prefilled in ``chunk``-token chunks up to its own prefill
    length, then all decoded as one batch (leaving it as their tokens run out)."""
    model, config = build(groups), dms(window)
    seqs, prefill = sequences((30, 41, 19)), [12, 30, 5]
    engine = Engine(model, config, page_size=4, max_batch=3, chunk_size=chunk)
    results = engine.score_batch(seqs, prefill_tokens=prefill, return_logits=True)
    for tokens, got in zip(seqs, results):
        logp, held, _ = reference(model, tokens, config)
        want = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(got.token_logprobs, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.log_softmax(got.logits.double(), -1), logp, atol=1e-4,
                                   rtol=0)
        assert torch.equal(got.compression.slots, held)
        if window < 9:
            assert got.compression.overall > 1.3, "decisions should evict"
        survivors = held - min(len(tokens), window + 1)
        ring = 2 * 2 * (window + 1) * (2 * 16 * 4 + 1)  # layers x kv x rows x (K, V fp32 + flag)
        assert got.cache_bytes["dmc_state"] == ring * groups // 2
        assert got.cache_bytes["kv"] == int(pages_for(survivors, 4).sum()) * 2 * 4 * 16 * 4
    assert engine.cache.pages_in_use == 0


# the interpreter's Triton runs take 20-25 s each: the fast suite keeps the static one, the
# step CUDA graphs capture
@pytest.mark.parametrize("groups,use_triton,graphs", [
    (4, None, False), (2, None, False), pytest.param(2, True, False, marks=pytest.mark.slow),
    (2, True, True)], ids=["mha", "gqa", "gqa-triton", "gqa-triton-static"])
def test_greedy_generation_equals_the_eval_mode_forward(parallel_1x1, groups, use_triton,
                                                        graphs):
    """``use_triton=True`` (the interpreter on the CPU): CUDA's default path, the Triton paged
    kernel with the window ring read in its ring mode and the Triton decode write; with
    ``cuda_graphs`` the static steps (run eagerly on the CPU) once every ring is full."""
    model, config = build(groups, seed=1), dms(3)
    prompts = sequences((13, 21, 7), seed=1)
    engine = Engine(model, config, page_size=4, max_batch=3, chunk_size=5,
                    use_triton=use_triton, cuda_graphs=graphs)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    for prompt, result in zip(prompts, results):
        fed = prompt + result.tokens[:-1]  # the last generated token is never fed back
        logp, held, _ = reference(model, fed, config)
        steps = logp[len(prompt) - 1:]
        assert steps.argmax(-1).tolist() == result.tokens
        picked = steps.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), picked,
                                   atol=1e-4, rtol=0)
        assert result.compression.tokens == len(fed)
        assert torch.equal(result.compression.slots, held)
        assert result.kv_pages == int(pages_for(held - 4, 4).sum())  # survivors' pages only
    assert engine.cache.pages_in_use == 0 and not engine.has_unfinished()
    assert engine.stats.peak_running == 3


def test_decode_queries_are_rotated_with_the_borrowed_channel_zeroed(parallel_1x1,
                                                                     monkeypatch):
    """write_token's PyTorch path (the CPU default) returns each decode query rotated at its
    position (float64 RoPE of the query with the borrowed channel zeroed) with the borrowed
    channel zero again after RoPE (rotate-half moves channel ``dim/2 - 1`` into it)."""
    from dmc.inference.kv_write_dms import DMSKV

    calls, write_token = [], DMSKV.write_token

    def spy(self, layer, step, query, key, value):
        out = write_token(self, layer, step, query, key, value)
        calls.append((query.clone(), step.positions.clone(), out.clone(), self.inv_freq,
                       self.group))
        return out

    monkeypatch.setattr(DMSKV, "write_token", spy)
    model, config = build(2, seed=1), dms(3)
    Engine(model, config, page_size=4, max_batch=2, chunk_size=8, use_triton=False).generate(
        sequences((13, 21), seed=1), SamplingParams(max_new_tokens=6))
    assert max(int(c[1].max()) for c in calls) == 21 + 6 - 2  # the last token fed back
    for query, positions, got, inv_freq, group in calls:
        want = query.double().clone()  # [batch, heads, dim]
        want[:, ::group, -1] = 0
        angles = positions.double()[:, None, None] * inv_freq.double()  # [batch, 1, dim / 2]
        first, second = want.chunk(2, dim=-1)
        want = torch.cat([first * angles.cos() - second * angles.sin(),
                          second * angles.cos() + first * angles.sin()], dim=-1)
        assert torch.equal(got[:, ::group, -1], torch.zeros_like(got[:, ::group, -1]))
        want[:, ::group, -1] = 0
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_out_of_pages_preempts_and_restarts_with_the_same_output(parallel_1x1):
    check_preemption(build(2), dms(2), sequences((10, 12, 9), seed=4), 24)


def test_dms_refuses_a_policy(parallel_1x1):
    from dmc.policies import get_policy

    with pytest.raises(ValueError, match="dmc.method='dms'"):
        Engine(build(2), dms(3), page_size=4, max_batch=1,
               policy=get_policy("h2o", compression_ratio=2.0))


@pytest.mark.gpu
def test_dms_engine_on_cuda_equals_the_eval_mode_forward(parallel_1x1):
    """The same PyTorch DMS path on CUDA: decisions on the device, lengths read back once per
    forward."""
    model, config = build(2), dms(3)
    assert next(model.parameters()).is_cuda
    seqs = sequences((30, 19))
    results = Engine(model, config, page_size=4, max_batch=2, chunk_size=7).score_batch(
        seqs, prefill_tokens=[12, 5])
    for tokens, got in zip(seqs, results):
        logp, held, _ = reference(model, tokens, config)
        want = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(got.token_logprobs, want, atol=1e-4, rtol=0)
        assert torch.equal(got.compression.slots, held)


@pytest.mark.parametrize("groups,window", [(4, 3), (2, 3), (2, 6)])
def test_engine_equals_the_dms_eval_mode_model(parallel_1x1, groups, window):
    """``Engine(model)`` picks DMS from the model's runtime ("auto"); its teacher-forced scores
    (chunks of 1 and 7 tokens, batched decode) and greedy tokens are the DMSSelfAttention
    model's in eval mode. The model's measured CR counts eventual evictions (DMS's CR loss), the
    engine the slots it holds: they differ by the evicted keys still inside the window."""
    model = build_dms(groups, window)
    assert isinstance(model.decoder.layers[0].self_attention, DMSSelfAttention)
    config = model.decoder.layers[0].self_attention.dmc.config
    seqs, prefill = sequences((33, 20, 26), seed=5), [14, 20, 3]
    for chunk in (1, 7):
        engine = Engine(model, page_size=4, max_batch=3, chunk_size=chunk)
        assert engine.dmc.method == "dms" and engine.dmc.dms_window == window
        for tokens, got in zip(seqs, engine.score_batch(seqs, prefill_tokens=prefill,
                                                        return_logits=True)):
            logp, kept = teacher_forced(model, tokens)
            torch.testing.assert_close(torch.log_softmax(got.logits.double(), -1), logp,
                                       atol=1e-4, rtol=0)
            ref_logp, held, marked = reference(model, tokens, config)
            torch.testing.assert_close(ref_logp, logp, atol=1e-4, rtol=0)  # the ops reference
            assert torch.equal(got.compression.slots, held)
            assert torch.equal(got.compression.slots - kept, marked)
            assert got.compression.overall > 1.2
    prompts = sequences((13, 21, 7), seed=6)
    results = Engine(model, page_size=4, max_batch=3, chunk_size=5).generate(
        prompts, SamplingParams(max_new_tokens=20))
    for prompt, result in zip(prompts, results):
        fed = prompt + result.tokens[:-1]
        steps = teacher_forced(model, fed)[0][len(prompt) - 1:]
        assert steps.argmax(-1).tolist() == result.tokens
        picked = steps.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), picked,
                                   atol=1e-4, rtol=0)


def test_a_saved_dms_model_loads_into_a_dms_engine(parallel_1x1, tmp_path):
    from dmc.inference import save_inference_state
    from test_engine import model_config

    model = build_dms(2, 3)
    config = model.decoder.layers[0].self_attention.dmc.config
    save_inference_state(tmp_path / "dms.pt", model, model_config(2), config)
    loaded = Engine.from_file(tmp_path / "dms.pt", page_size=4, max_batch=2)
    assert loaded.dmc == config and loaded.cache.ring_size == 4
    prompts, params = sequences((9, 14), seed=7), SamplingParams(max_new_tokens=6)
    direct = Engine(model, page_size=4, max_batch=2).generate(prompts, params)
    assert [r.tokens for r in loaded.generate(prompts, params)] == [r.tokens for r in direct]


def test_the_byte_budget_holds_the_window_rings(parallel_1x1):
    """kv_cache_bytes covers everything the cache allocates, under DMS the rings of every
    sequence slot among it."""
    model = build(2)
    rings = 3 * 2 * 2 * 4 * (2 * 16 * 4 + 1)  # max_batch x layers x kv x (w + 1) rows
    budget = cache_allocation(num_pages=10, max_seqs=3, window=None, dms_window=3,
                              **CACHE_SHAPE)["total"]
    assert Engine(model, dms(3), max_batch=3, kv_cache_bytes=budget - 1).cache.num_pages == 9
    engine = Engine(model, dms(3), max_batch=3, kv_cache_bytes=budget)
    assert engine.cache.num_pages == 10
    assert engine.cache.ring_k.numel() * 4 * 2 + engine.cache.ring_evict.numel() == rings


def test_a_pool_that_holds_the_survivors_is_enough(parallel_1x1):
    """Every token kept (c large): 44 tokens leave 34 survivors per head beside the 10-row ring,
    9 pages of 4 slots per head, 36 in all. The scheduler reserves only what leaves the ring, so
    the 40-token prompt is one chunk (a one-slot-per-token worst case, 10 pages per head, would
    cut it to 36 tokens)."""
    model, config = build(2), dms(9, c=1e4)
    engine = Engine(model, config, page_size=4, max_batch=1, chunk_size=64, num_pages=36)
    prompt = sequences((40,))[0]
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [n for _, n in engine.scheduler.schedule().prefill] == [40]
    engine.scheduler.preempt(engine.scheduler.running[0])
    while engine.has_unfinished():
        finished = engine.step()
    assert finished[0].finish_reason == "length"
    assert finished[0].compression.slots.tolist() == [[43, 43]] * 2  # 33 paged + 10 in the ring
