"""DMCSelfAttention inside a tiny megatron GPTModel (single process, CPU)."""
import shutil

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dmc.megatron.attention import dmc_layers, zero_decision_rows_
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.ops import compression_loss, compression_loss_from_sums
from dmc.ops.reference import compression_loss_reference

from llama_reference import decode_with_compressed_cache
from tiny_models import assert_same_train_step, decision_rows, spread_decisions, tiny_config

VOCAB, SEQ = 96, 24


def _batch(batch=2, seq=SEQ, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return tokens, torch.arange(seq).expand(batch, seq)


def _pair(groups, dmc_config=None, **overrides):
    """A vanilla model and a DMC model with the same weights (``overrides``: TransformerConfig
    fields; with ``qk_layernorm`` the q/k norm weights are drawn around 1)."""
    config = tiny_config(groups, **overrides)
    vanilla = build_gpt_model(config, VOCAB, 64)
    with torch.no_grad():
        for name, param in vanilla.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
    runtime = DMCRuntime(dmc_config or DMCConfig())
    dmc = build_gpt_model(config, VOCAB, 64, dmc=runtime)
    dmc.load_state_dict(vanilla.state_dict())
    return vanilla, dmc, runtime


@pytest.mark.parametrize("groups", [4, 2])
def test_at_initialisation_dmc_matches_vanilla(parallel_1x1, groups):
    vanilla, dmc, runtime = _pair(groups)
    zero_decision_rows_(dmc)
    vanilla.load_state_dict(dmc.state_dict())
    tokens, positions = _batch()
    with torch.no_grad():
        reference = vanilla(tokens, positions, None)
        for mode in ("eval", "train"):
            runtime.set_mode(mode)
            logits = dmc(tokens, positions, None)
            rel = ((logits - reference).norm() / reference.norm()).item()
            assert rel < 1e-3, (mode, rel)


@pytest.mark.parametrize("groups,window", [(4, None), (2, None), (2, SEQ)])
def test_eval_mode_equals_token_by_token_compressed_cache(parallel_1x1, groups, window):
    _, dmc, runtime = _pair(groups, DMCConfig(window=window, c=0.5))
    spread_decisions(dmc)
    runtime.set_mode("eval")
    tokens, positions = _batch()
    with torch.no_grad():
        logits = dmc(tokens, positions, None)
    reference, sizes = decode_with_compressed_cache(
        dmc.state_dict(), tokens, num_layers=2, num_heads=4, num_groups=groups,
        eps=1e-5, rotary_base=10000.0, c=0.5,
    )
    cache_tokens = sizes.sum().item()
    assert SEQ * 2 * 2 * groups / cache_tokens > 1.3, "decisions should compress"
    torch.testing.assert_close(logits.double(), reference, rtol=1e-4, atol=1e-4)
    measured_kept = sum(layer.cr_kept.sum().item() for layer in dmc_layers(dmc))
    assert measured_kept == cache_tokens


def test_vanilla_reference_decoder_matches_megatron(parallel_1x1):
    vanilla, _, _ = _pair(2)
    tokens, positions = _batch(batch=1, seq=10)
    with torch.no_grad():
        logits = vanilla(tokens, positions, None)
    reference, _ = decode_with_compressed_cache(
        vanilla.state_dict(), tokens, num_layers=2, num_heads=4, num_groups=2, eps=1e-5,
        rotary_base=10000.0, dmc=False,
    )
    torch.testing.assert_close(logits.double(), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk_layernorm"])
def test_zero_out_scales_decision_channels(parallel_1x1, qk_norm):
    """Scale 1 is the vanilla model; scale 0 is the model after the hand-off
    (zero_decision_rows_) in zero_out mode and, with c huge (no merges), in eval mode. With a
    per-head q/k norm the channels are scaled before the norm: zeroing a row after scaling the
    norm's output would change the RMS of the other channels (checked: they differ)."""
    vanilla, dmc, runtime = _pair(2, DMCConfig(c=1e4), qk_layernorm=qk_norm)
    tokens, positions = _batch()
    runtime.set_mode("zero_out")
    with torch.no_grad():
        runtime.zero_out_scale = 1.0
        reference = vanilla(tokens, positions, None)
        torch.testing.assert_close(dmc(tokens, positions, None), reference)
        runtime.zero_out_scale = 0.5
        halfway = dmc(tokens, positions, None)
        assert (halfway - reference).abs().max() > 1e-5
        runtime.zero_out_scale = 0.0
        scaled_to_zero = dmc(tokens, positions, None)
        assert zero_decision_rows_(dmc) == 2
        torch.testing.assert_close(dmc(tokens, positions, None), scaled_to_zero,
                                   rtol=1e-6, atol=1e-6)
        runtime.set_mode("eval")
        torch.testing.assert_close(dmc(tokens, positions, None), scaled_to_zero,
                                   rtol=1e-5, atol=1e-5)
        layer = dmc_layers(dmc)[0]
        query, key, _ = layer.get_query_key_value_tensors(torch.randn(5, 2, 64))
    assert (query[..., -1] == 0).all() and (key[..., -1] == 0).all()
    assert (query[..., :-1] != 0).any()


def _eval_and_zero_out_logits(model, runtime, tokens, positions):
    """Float64 logits of ``model`` in eval, zero_out (scale 0) and vanilla mode."""
    out = {}
    with torch.no_grad():
        for mode in ("eval", "zero_out", "vanilla"):
            runtime.set_mode(mode)
            runtime.zero_out_scale = 0.0
            out[mode] = model(tokens, positions, None).double()
    return out


def test_end_of_zero_out_equals_dmc_eval_without_merges(parallel_1x1):
    """At scale 0 the zero_out model is the DMC model that never merges, at head_dim 128 over
    2048 positions: RoPE's rotate-half moves q[d/2 - 1] into the last channel (sin of the
    slowest frequency, ~0.2 at position 2048), so the channel must be scaled after RoPE too."""
    torch.manual_seed(0)
    seq = 2048
    config = llama_transformer_config(2, 256, 2, 512)
    runtime = DMCRuntime(DMCConfig(window=12, c=5.0))
    model = build_gpt_model(config, VOCAB, seq, dmc=runtime)
    zero_decision_rows_(model)  # alpha logits are -c: no token merges
    for layer in dmc_layers(model):  # a large channel d/2 - 1 in q and k, as trained models have
        rows = [row - 64 for row in decision_rows(layer)]
        with torch.no_grad():
            layer.linear_qkv.weight[rows] = torch.randn(len(rows), 256) * 0.5
    tokens, positions = _batch(batch=1, seq=seq, seed=3)
    logits = _eval_and_zero_out_logits(model, runtime, tokens, positions)
    after = (logits["zero_out"] - logits["eval"]).abs().max().item()
    # megatron's own attention, what zero_out computed when it scaled before RoPE only
    before = (logits["vanilla"] - logits["eval"])[:, 1024:].abs().max().item()
    print(f"max |logit diff| zero_out(scale 0) vs eval, no merges: {after:.2e} "
          f"(pre-RoPE scaling only: {before:.2e} at positions 1024-2048)")
    assert after < 1e-4
    assert before > 1e-2
    assert all(layer.cr_kept.sum() == 2 * seq for layer in dmc_layers(model))  # no merge


def _capture_alphas(model) -> list:
    """Makes each DMC layer keep the alphas of its forwards (``[batch, kv_heads, seq]``, in layer
    order, gradients retained)."""
    captured = []
    for layer in dmc_layers(model):
        def record(alpha_logit, decide=layer._decisions):
            alpha, log_keep = decide(alpha_logit)
            if alpha.requires_grad:
                alpha.retain_grad()
            captured.append(alpha)
            return alpha, log_keep
        layer._decisions = record
    return captured


def _expected_alpha_grad(counted, target_cr, prior):
    """d loss / d alpha of Eq. 10 (float64), ``counted [batch, layers, heads, seq]``: -1 / (batch
    n_l n_h n) wherever the sequence's (global) or the layer's (local) hinge is active."""
    batch, layers, heads, seq = counted.shape
    kept = (1 - counted).sum(dim=(2, 3))  # [batch, layers]
    if prior == "global":
        active = (kept.sum(dim=1, keepdim=True) > layers * heads * seq / target_cr)
        active = active.expand(batch, layers)
    else:
        active = kept > heads * seq / target_cr
    grad = -active.double() / (batch * layers * heads * seq)
    return grad[:, :, None, None].expand_as(counted)


@pytest.mark.parametrize("prior", ["global", "local"])
@pytest.mark.parametrize("hard_loss,weight", [(False, 1.0), (True, 1.0), (False, 2.5)])
def test_train_mode_cr_loss_is_eq10_per_sequence(parallel_1x1, prior, hard_loss, weight):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, prior=prior, hard_loss=hard_loss))
    runtime.cr_loss_weight = weight  # logged unweighted, backpropagated times the weight
    spread_decisions(dmc, scale=2.0)
    runtime.set_mode("train")
    tokens, positions = _batch(batch=3)
    alphas = _capture_alphas(dmc)
    with torch.no_grad():  # same noise as the forward below: it is keyed by step and micro-batch
        other_logits = dmc(tokens, positions, None)
    alpha = torch.stack(alphas, dim=1).double()  # [batch, layers, heads, seq]
    counted = (alpha > 0.5).double() if hard_loss else alpha
    kept_fraction = (1 - counted).mean(dim=(1, 2, 3))
    # a target between the sequences: one keeps more than 1 / CR, another fewer
    runtime.target_cr = 2 / (kept_fraction.min() + kept_fraction.max()).item()
    alphas.clear()
    logits = dmc(tokens, positions, None)
    cr_loss = sum(runtime.pop_cr_losses())
    want = compression_loss_reference(counted, runtime.target_cr, prior)
    assert cr_loss.item() == pytest.approx(want, abs=1e-6) and want > 1e-3
    batch_sum = compression_loss_from_sums((1 - counted).sum()[None], counted.numel(),
                                           runtime.target_cr)
    assert prior == "local" or abs(batch_sum.item() - want) > 1e-3
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # a class attribute: other tests set it
    (logits.sum() * 0).backward()  # only the attached CR loss produces gradients
    # the last layer's alphas reach the loss directly only (earlier ones also through the
    # hidden states that decide later layers' alphas)
    expected = weight * _expected_alpha_grad(counted, runtime.target_cr, prior)[:, -1]
    torch.testing.assert_close(alphas[-1].grad.double(), expected, rtol=1e-5, atol=1e-9)
    assert dmc_layers(dmc)[0].linear_qkv.weight.grad[decision_rows(dmc_layers(dmc)[0])].any()
    # hard_loss changes the loss only, never the attention
    torch.testing.assert_close(logits.detach(), other_logits, rtol=0, atol=0)


@pytest.mark.parametrize("terms", [
    {"head_cr_cap": 1.6},
    {"head_balance_weight": 0.6},
    {"head_balance_weight": 0.6, "hard_loss": True},
], ids=["cap", "balance", "balance-hard-loss"])
def test_train_mode_extra_cr_terms_are_the_float64_loss(parallel_1x1, terms):
    """The per-head cap and DMC-C's balance term (Eq. 13) on top of Eq. 10: value and gradient
    equal the float64 loss of the alphas the forward drew."""
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, **terms))
    cap, weight = terms.get("head_cr_cap"), terms.get("head_balance_weight", 0.0)
    spread_decisions(dmc, scale=2.0)
    runtime.set_mode("train")
    runtime.target_cr = 1.5
    tokens, positions = _batch(batch=3)
    alphas = _capture_alphas(dmc)
    logits = dmc(tokens, positions, None)
    alpha = torch.stack(alphas, dim=1).detach().double()  # [batch, layers, heads, seq]
    seen = (alpha > 0.5).double() if terms.get("hard_loss") else alpha
    if cap is not None:
        heads_cr = alpha.shape[3] / (1 - alpha).sum(dim=3)
        assert (heads_cr > cap).any() and (heads_cr < cap).any()
    cr_loss = sum(runtime.pop_cr_losses())
    want = compression_loss_reference(seen, runtime.target_cr, "global", cap, weight)
    assert cr_loss.item() == pytest.approx(want, abs=1e-6)
    assert want > compression_loss_reference(seen, runtime.target_cr, "global") + 1e-4
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    (logits.sum() * 0).backward()
    last = seen[:, -1].clone().requires_grad_(True)
    compression_loss(torch.cat([seen[:, :-1], last[:, None]], dim=1), runtime.target_cr,
                     "global", cap, weight).backward()
    torch.testing.assert_close(alphas[-1].grad.double(), last.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("hard_loss", [False, True])
def test_measured_cr_is_tokens_over_kept_slots_of_the_forwards_alphas(parallel_1x1, hard_loss):
    """After one train-mode forward each layer's measured CR per head is batch * seq / sum(1 -
    alpha) in float64 over the alphas it drew (rounded under hard_loss), every token counted."""
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, hard_loss=hard_loss))
    spread_decisions(dmc, scale=2.0)
    runtime.set_mode("train")
    runtime.target_cr = 1.5
    tokens, positions = _batch(batch=3)
    alphas = _capture_alphas(dmc)
    for layer in dmc_layers(dmc):
        layer.reset_cr_stats()
    with torch.no_grad():
        dmc(tokens, positions, None)
    runtime.pop_cr_losses()
    assert len(alphas) == len(dmc_layers(dmc))
    for layer, alpha in zip(dmc_layers(dmc), alphas):
        alpha = alpha.detach().double()  # [batch, kv_heads, seq]
        counted = (alpha > 0.5).double() if hard_loss else alpha
        want = alpha.shape[0] * SEQ / (1 - counted).sum(dim=(0, 2))
        assert alpha.shape[0] * alpha.shape[2] == 3 * SEQ and (want > 1.05).all()
        torch.testing.assert_close(layer.measured_cr().double(), want, rtol=1e-6, atol=0)


def test_noise_is_keyed_by_step_and_microbatch(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0))
    spread_decisions(dmc, scale=0.5)
    runtime.set_mode("train")
    tokens, positions = _batch()
    with torch.no_grad():
        first = dmc(tokens, positions, None)
        torch.manual_seed(99)  # global RNG state must not matter
        again = dmc(tokens, positions, None)
        runtime.step += 1
        other = dmc(tokens, positions, None)
    torch.testing.assert_close(first, again)
    assert (first - other).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("delay", [0, 3], ids=["dmc", "merge_delay"])
def test_flex_backend_matches_dense(parallel_1x1, mode, delay):
    _, dense_model, dense_rt = _pair(2, DMCConfig(window=4, c=0.0, attention_backend="dense",
                                                  merge_delay=delay))
    spread_decisions(dense_model, scale=1.0)
    flex_rt = DMCRuntime(DMCConfig(window=4, c=0.0, attention_backend="flex", merge_delay=delay))
    flex_model = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=flex_rt)
    flex_model.load_state_dict(dense_model.state_dict())
    dense_rt.set_mode(mode)
    flex_rt.set_mode(mode)
    tokens, positions = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            flex_model(tokens, positions, None), dense_model(tokens, positions, None),
            rtol=1e-4, atol=1e-4,
        )


@pytest.mark.parametrize("backend", ["flex-channel", "flex-transposed"])
@pytest.mark.parametrize("delay,hard", [(0, False), (0, True), (3, False)],
                         ids=["dmc", "dmc-hard", "merge_delay"])
def test_flex_train_step_wired_end_to_end(parallel_1x1, monkeypatch, backend, delay, hard):
    """A train-mode step (Gumbel decisions, CR loss) through the FlexAttention backends with
    FlexAttention replaced by a plain-torch one (:mod:`flex_reference`; it has no CPU
    backward): the loss and every parameter gradient equal the dense backend's, as the GPU
    test does with the real kernels (test_attention_gpu.py)."""
    import torch.nn.attention.flex_attention as flex_module

    from flex_reference import reference_flex

    monkeypatch.setattr(flex_module, "flex_attention", reference_flex)
    _, reference, _ = _pair(2)
    spread_decisions(reference, scale=1.0)
    models = []
    for name in (backend, "dense"):
        runtime = DMCRuntime(DMCConfig(window=4, c=0.0, hard=hard, attention_backend=name,
                                       merge_delay=delay))
        model = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=runtime)
        model.load_state_dict(reference.state_dict())
        models.append((model, runtime))
    assert_same_train_step(models, *_batch())


def _zeroing_around_megatrons_rope(layer, query, key, rotary_pos_emb):
    """The three passes the rotation tables replace: the decision channels zeroed, megatron's
    RoPE, the keys' zeroed again (the query's left as RoPE makes it: the keys' zeros take it
    out of every score and of the query's gradient)."""
    from dmc.ops import zero_decision_channel

    query, key = layer._rotate(zero_decision_channel(query), zero_decision_channel(key),
                               rotary_pos_emb)
    return query, zero_decision_channel(key)


@pytest.mark.parametrize("delay", [0, 3], ids=["dmc", "merge_delay"])
def test_rope_without_decision_channels_changes_no_bit_of_a_train_step(parallel_1x1,
                                                                       monkeypatch, delay):
    """A train step's loss and every gradient with RoPE through tables without the decision
    channels equal, bit for bit, those of zeroing the channels around megatron's RoPE."""
    from dmc.megatron.attention import DMCSelfAttention

    _, model, runtime = _pair(2, DMCConfig(window=4, c=0.0, merge_delay=delay))
    spread_decisions(model, scale=1.0)
    runtime.set_mode("train")
    runtime.target_cr = 2.0
    tokens, positions = _batch()

    def step():
        runtime.step = 0
        model.zero_grad(set_to_none=True)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    tables = step()
    monkeypatch.setattr(DMCSelfAttention, "_rotate_without_decisions",
                        _zeroing_around_megatrons_rope)
    zeroed = step()
    assert len(tables) > 10 and all(torch.equal(a, b) for a, b in zip(tables, zeroed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotated", [1.0, 0.5], ids=["full", "partial-rope"])
def test_rotation_without_decision_channels(parallel_1x1, dtype, rotated):
    """One layer's rotation of random queries and keys (a long sequence, the angles of
    megatron's rotary embedding): the keys' decision channel exactly 0, the outputs (the
    query's but its decision channel, which the three passes leave in place) and the input
    gradients equal to the three passes', bit for bit, under upstream gradients whose query
    decision channel is 0, as the keys' zeros make it in the attention; partial RoPE (half
    the channels rotated) takes those three passes."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from dmc.megatron.attention import dmc_layers

    _, model, _ = _pair(2)
    layer = dmc_layers(model)[0]
    seq, dim = 2048, layer.hidden_size_per_attention_head
    freqs = RotaryEmbedding(dim, rotary_percent=rotated)(seq)  # [seq, 1, 1, dim * rotated]
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(seq, 2, 4, dim, generator=gen).to(dtype).requires_grad_()
    key = torch.randn(seq, 2, 2, dim, generator=gen).to(dtype).requires_grad_()
    grads = [torch.randn(seq, 2, heads, dim, generator=gen).to(dtype) for heads in (4, 2)]
    grads[0][..., -1] = 0
    results = []
    for rotate in (layer._rotate_without_decisions,
                   lambda *args: _zeroing_around_megatrons_rope(layer, *args)):
        outs = rotate(query, key, freqs)
        torch.autograd.backward(outs, grads)
        results.append([outs[0].detach()[..., :-1], outs[1].detach(), query.grad, key.grad])
        query.grad = key.grad = None
    assert results[0][1][..., -1].eq(0).all()
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][0].abs().sum() > 0 and results[0][2][..., :-1].abs().sum() > 0


def test_layers_share_the_rotation_tables_of_one_angles_tensor(parallel_1x1, monkeypatch):
    """The tables are built once per angles tensor, dtype and inference mode, not once per
    layer or forward, and equal freshly built ones; a train step after an inference-mode
    forward does not reuse that forward's tables (autograd could not save them)."""
    from dmc.megatron import runtime as runtime_module
    from dmc.ops import without_decision_channel
    from dmc.ops.rope import rotation_tables

    built = []
    monkeypatch.setattr(runtime_module, "rotation_tables",
                        lambda *args: built.append(args) or rotation_tables(*args))
    _, model, runtime = _pair(2, DMCConfig(window=4))
    runtime.start_step(0, "train", target_cr=2.0)
    tokens, positions = _batch()
    with torch.inference_mode():
        model(tokens, positions, None)
    assert len(built) == 1 and len(dmc_layers(model)) > 1
    for _ in range(2):
        model(tokens, positions, None, labels=tokens).float().mean().backward()
    assert len(built) == 2
    model(*_batch(seq=SEQ - 4), None)
    assert len(built) == 3
    for (angles_id, dtype, _), entry in runtime._rope_tables.items():
        fresh = without_decision_channel(*rotation_tables(entry[0], dtype))
        assert id(entry[0]) == angles_id
        assert all(torch.equal(a, b) for a, b in zip(entry[1], fresh))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("hard, delay", [(False, 0), (True, 3)], ids=["dmc", "hard-delay"])
def test_compiled_elementwise_math_trains_and_evaluates_as_eager(parallel_1x1, hard, delay):
    """``dmc.compile_elementwise``: a train step's loss and gradients (decision rows
    included) and the eval-mode logits those of the eager layer, to float32 rounding; the
    decisions and the rotation go through compiled graphs."""
    from dmc.megatron import attention

    reference = build_gpt_model(tiny_config(2), VOCAB, 64)
    spread_decisions(reference, scale=1.0)
    models = []
    for compile_elementwise in (True, False):
        runtime = DMCRuntime(DMCConfig(window=4, c=0.0, hard=hard, merge_delay=delay,
                                       compile_elementwise=compile_elementwise))
        model = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=runtime)
        model.load_state_dict(reference.state_dict())
        models.append((model, runtime))
    tokens, positions = _batch()
    attention.compiled.cache_clear()
    assert_same_train_step(models, tokens, positions)
    assert attention.compiled.cache_info().currsize == 3  # logits, decisions, rotation
    logits = []
    for model, runtime in models:
        runtime.set_mode("eval")
        with torch.no_grad():
            logits.append(model(tokens, positions, None))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_hard_straight_through_training_is_finite(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, hard=True))
    spread_decisions(dmc, scale=1.0)
    runtime.set_mode("train")
    runtime.target_cr = 2.0
    tokens, positions = _batch()
    loss = dmc(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in dmc.parameters() if p.grad is not None)


def test_merge_delay_over_the_whole_sequence_is_vanilla(parallel_1x1):
    vanilla, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, merge_delay=SEQ))
    spread_decisions(dmc, scale=1.0)
    vanilla.load_state_dict(dmc.state_dict())
    for layer in (m for m in vanilla.modules() if hasattr(m, "linear_qkv")):
        with torch.no_grad():  # DMC takes the decision channels out of q.k; so does this model
            layer.linear_qkv.weight[decision_rows(layer)] = 0
    tokens, positions = _batch()
    runtime.set_mode("eval")
    with torch.no_grad():
        torch.testing.assert_close(dmc(tokens, positions, None), vanilla(tokens, positions, None),
                                   rtol=1e-4, atol=1e-4)
    assert all(layer.measured_cr().min() > 1.3 for layer in dmc_layers(dmc))  # it does merge


@pytest.mark.parametrize("delay", [3, SEQ - 3])
def test_merge_delay_trains_the_decisions(parallel_1x1, delay):
    # the LM loss alone (no CR loss) reaches the decision rows, up to the longest delay at
    # which a query sees a merged slot (keys 0 and 1 merged are seen from position delay + 2)
    _, dmc, runtime = _pair(2, DMCConfig(window=4, c=0.0, merge_delay=delay))
    spread_decisions(dmc, scale=1.0)
    runtime.set_mode("train")
    runtime.target_cr, runtime.cr_loss_weight = 4.0, 0.0
    tokens, positions = _batch()
    dmc(tokens, positions, None, labels=tokens).mean().backward()
    for layer in dmc_layers(dmc):
        grad = layer.linear_qkv.weight.grad[decision_rows(layer)]
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_dmc_modes_refuse_an_attention_mask(parallel_1x1):
    _, dmc, runtime = _pair(2, DMCConfig(window=4))
    tokens, positions = _batch()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    for mode in ("train", "eval"):
        runtime.set_mode(mode)
        with pytest.raises(ValueError, match="attention_mask must be None"):
            dmc(tokens, positions, mask)


def test_bad_settings_fail_clearly(parallel_1x1):
    with pytest.raises(ValueError, match="mode must be one of"):
        DMCRuntime().set_mode("inference")
    with pytest.raises(ValueError, match="dmc.window"):
        DMCConfig(window=0)
    with pytest.raises(ValueError, match="dmc.merge_delay: must be an integer >= 0"):
        DMCConfig(merge_delay=-1)
    with pytest.raises(ValueError, match="dmc.merge_delay: needs dmc.method: dmc"):
        DMCConfig(method="dms", merge_delay=4)
    with pytest.raises(ValueError, match="dmc.attention_backend: 'flex-channel' needs "
                                         "dmc.method: dmc"):
        DMCConfig(method="dms", attention_backend="flex-channel")
    assert "merge_delay" not in DMCConfig().to_dict()
    assert DMCConfig.from_dict(DMCConfig(merge_delay=8).to_dict()).merge_delay == 8
    with pytest.raises(ValueError, match="attention_dropout"):
        build_gpt_model(
            llama_transformer_config(1, 32, 2, 64, attention_dropout=0.1), VOCAB, 16,
            dmc=DMCRuntime(),
        )


@pytest.mark.parametrize("groups,hard_loss", [(4, False), (2, True)])
def test_cr_loss_grad_decisions_reaches_the_decision_rows_only(parallel_1x1, groups, hard_loss):
    """``dmc.cr_loss_grad: decisions``: the same CR loss value as the paper's ``model`` scope,
    the same gradient on the last layer's k[..., -1] rows, no gradient beyond those rows."""
    grads, losses = {}, {}
    for scope in ("model", "decisions"):
        config = DMCConfig(window=4, c=0.0, hard_loss=hard_loss, cr_loss_grad=scope)
        torch.manual_seed(0)  # the same weights for both scopes
        _, dmc, runtime = _pair(groups, config)
        spread_decisions(dmc, scale=2.0)
        runtime.set_mode("train")
        runtime.target_cr = 8.0  # far from met: the hinge is active for every sequence
        tokens, positions = _batch(batch=3)
        logits = dmc(tokens, positions, None)
        losses[scope] = sum(runtime.pop_cr_losses())
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        (logits.sum() * 0).backward()  # only the attached CR loss produces gradients
        grads[scope] = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        for name, p in dmc.named_parameters()}
        layers = dmc_layers(dmc)
    assert losses["model"].item() > 1e-3
    torch.testing.assert_close(losses["decisions"], losses["model"], rtol=1e-6, atol=0)
    per_group = layers[0].num_attention_heads_per_partition // groups
    k_rows = decision_rows(layers[0])[per_group::per_group + 1]
    names = [n for n, _ in dmc.named_parameters()]
    qkv = [n for n in names if n.endswith("linear_qkv.weight")]
    # the last layer's rows reach the loss directly only (earlier ones also through the hidden
    # states that decide later layers' alphas, a path the decisions scope cuts)
    torch.testing.assert_close(grads["decisions"][qkv[-1]][k_rows],
                               grads["model"][qkv[-1]][k_rows], rtol=1e-4, atol=1e-6)
    for name in qkv:
        assert grads["decisions"][name][k_rows].abs().sum() > 0
        others = torch.ones(grads["decisions"][name].shape[0], dtype=torch.bool)
        others[k_rows] = False
        assert not grads["decisions"][name][others].any(), name
    for name in set(names) - set(qkv):
        assert not grads["decisions"][name].any(), name
    assert any(grads["model"][name].any() for name in set(names) - set(qkv))


def test_cr_loss_grad_is_validated():
    with pytest.raises(ValueError, match="dmc.cr_loss_grad: 'all' is not one of model"):
        DMCConfig(cr_loss_grad="all")
    with pytest.raises(ValueError, match="dmc.cr_loss_grad: 'decisions' needs dmc.method: dmc"):
        DMCConfig(method="dms", cr_loss_grad="decisions")
    assert "cr_loss_grad" not in DMCConfig(cr_loss_grad="decisions").to_dict()
