"""DMS export to transformers (DMS paper, arXiv 2506.05345, Sec. 3: delayed eviction): the
exported folder loads with trust_remote_code, its logits equal the eval-mode
``DMSSelfAttention`` model's (full forward and teacher-forced through the HF cache), generate()
produces dmc.inference.Engine's greedy tokens (one sequence and a left-padded batch), and the HF
cache holds exactly each head's survivors plus the window, as the engine does; its weights map
back to the megatron ones. Borrowed-channel and adapter decisions (``dms_decision``)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import mcore_to_hf  # noqa: E402
from dmc.inference import Engine, SamplingParams  # noqa: E402
from dmc.convert.hf_io import read_hf_weights  # noqa: E402
from dmc.convert.mapping import hf_to_mcore_state  # noqa: E402
from dmc.megatron.config import ModelConfig  # noqa: E402
from dmc_models import (VOCAB, full_state, megatron_logits, model_config, save_tiny,  # noqa: E402
                        tiny_dms)

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
NEW = 16


def export(tmp_path, groups, window, c, adapter=False):
    model, cfg, dms = tiny_dms(groups, window, c, adapter=adapter)
    save_tiny(model, cfg, dms, tmp_path / "mc", target_cr=2.0)
    sample = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    info = mcore_to_hf(tmp_path / "mc", tmp_path / "hf", cr_tokens=sample)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           trust_remote_code=True).eval()
    return model, hf, info


def held_reference(hf, ids):
    """``[layers, kv_heads]`` entries a query at the last of ``ids [1, n]`` sees, from the
    full forward's decisions: the last ``w + 1`` tokens plus the unmarked older ones."""
    n, w = ids.shape[1], hf.config.dms_window
    inputs = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out: inputs.append(a[0]))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    held = []
    for layer, x in zip(hf.model.layers, inputs):
        attn = layer.self_attn
        if attn.dms_decision_proj is not None:  # adapter decisions
            logit = attn.dms_decision_proj(x)[0].T  # [kv, n]
        else:
            logit = attn.q_proj(x).view(n, attn.heads, attn.head_dim)[:, ::attn.group, -1].T
        evict = logit * attn.logit_scale - attn.c > 0  # [kv, n]
        marked = torch.zeros_like(evict)
        marked[:, :-1] = evict[:, 1:]  # alpha_{j+1} marks key j
        old = torch.arange(n) < n - 1 - w
        held.append((~(marked & old)).sum(-1))
    return torch.stack(held)


@pytest.mark.parametrize("groups,window,c,adapter", [
    (2, 4, 10.0, False), (4, 3, 0.0, False), (2, 4, 0.0, True)],
    ids=["gqa", "mha", "gqa-adapter"])
def test_exported_dms_model_matches_megatron_and_engine(tmp_path, groups, window, c, adapter):
    """``adapter``: DMS adapter decisions, exported as ``dms_decision: adapter`` with
    ``self_attn.dms_decision_proj.weight``, and back (hf_to_mcore_state maps it)."""
    model, hf, info = export(tmp_path, groups, window, c, adapter)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dms_decision", "query") == ("adapter" if adapter else "query")
    hf_weights = read_hf_weights(tmp_path / "hf")
    assert ("model.layers.1.self_attn.dms_decision_proj.weight" in hf_weights) == adapter
    back = hf_to_mcore_state(hf_weights, ModelConfig.from_dict(model_config(groups)))
    want_state = full_state(model)
    assert set(back) == set(want_state)
    assert all(torch.equal(back[k], v) for k, v in want_state.items())
    assert config["architectures"] == ["DMSLlamaForCausalLM"]
    assert config["dms_window"] == window and config["dms_c"] == c
    assert config["dms_logit_scale"] == 100.0 and config["dms_channel"] == "last"
    assert config["dms_target_cr"] == 2.0 and "dmc_window" not in config
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dms.DMSLlamaForCausalLM"
    assert info["measured_cr"] > 1.2  # decisions really evict

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    want = megatron_logits(model, ids)
    with torch.no_grad():
        got = hf(ids, use_cache=False).logits
        cached = hf(ids[:, :25], use_cache=True)
        assert type(cached.past_key_values).__name__ == "DMSCache"
        steps = [cached.logits]
        cache = cached.past_key_values
        for t in range(25, 40):  # teacher forcing through the evicting cache
            out = hf(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    diff = (got - want).abs().max().item()
    diff_cache = (torch.cat(steps, dim=1) - want).abs().max().item()
    print(f"max |logit diff| HF DMS vs megatron eval ({groups} groups, window {window}): "
          f"{diff:.2e}; through the HF cache: {diff_cache:.2e}")
    assert diff < 1e-5 and diff_cache < 1e-5
    for row in range(2):
        want_held = held_reference(hf, ids[row:row + 1])
        assert torch.equal(cache.slot_counts()[:, row], want_held)
    assert (cache.slot_counts() < 40 - window).any()

    prompts = [ids[0, :11].tolist(), ids[1, :19].tolist()]
    engine = Engine(model, max_batch=2, max_seq_len=64)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    for prompt, result in zip(prompts, results):
        ids_1 = torch.tensor([prompt])
        out = hf.generate(ids_1, attention_mask=torch.ones_like(ids_1), max_new_tokens=NEW,
                          do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        assert out.sequences[0, len(prompt):].tolist() == result.tokens
        slots = out.past_key_values.slot_counts()[:, 0]  # [layers, kv_heads]
        assert torch.equal(slots.cpu(), result.compression.slots)

    # batched with left padding
    width = max(map(len, prompts))
    batch = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True)
    for i, result in enumerate(results):
        assert out.sequences[i, width:].tolist() == result.tokens
        assert torch.equal(out.past_key_values.slot_counts()[:, i].cpu(),
                           result.compression.slots)
