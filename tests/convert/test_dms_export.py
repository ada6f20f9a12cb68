"""DMS export to transformers (DMS paper, arXiv 2506.05345, Sec. 3: delayed eviction): the
exported folder loads with trust_remote_code, its logits equal the eval-mode
``DMSSelfAttention`` model's (full forward and teacher-forced through the HF cache), generate()
produces dmc.inference.Engine's greedy tokens (one sequence and a left-padded batch), and the HF
cache holds exactly each head's survivors plus the window, as the engine does; its weights map
back to the megatron ones; it loads where dmc is not installed. Borrowed-channel and adapter
decisions (``dms_decision``)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert.hf_io import read_hf_weights  # noqa: E402
from dmc.convert.mapping import hf_to_mcore_state  # noqa: E402
from dmc.megatron.config import ModelConfig  # noqa: E402
from dmc_models import (VOCAB, check_beam_search_matches_uncached,  # noqa: E402
                        check_generate_matches_engine, check_hf_logits, export_tiny, full_state,
                        logits_without_dmc, model_config, tiny_dms)

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
NEW = 16


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


@pytest.mark.parametrize("groups,window,c,adapter,scale", [
    (2, 4, 10.0, None, 100.0), (4, 3, 0.0, None, 100.0), (2, 4, 0.0, 0.01, 100.0),
    (2, 4, 2.0, 0.02, 100.0), (2, 4, 1.0, None, 10.0)],
    ids=["gqa", "mha", "gqa-adapter", "gqa-adapter-c2", "gqa-scale10"])
def test_exported_dms_model_matches_megatron_and_engine(tmp_path, groups, window, c, adapter,
                                                        scale):
    """``adapter`` (the ``decision_proj`` std, or None): DMS adapter decisions, exported as
    ``dms_decision: adapter`` with ``self_attn.dms_decision_proj.weight``, and back
    (hf_to_mcore_state maps it); ``c`` and ``scale`` (``dms_logit_scale``) as trained. The cache
    after a prefill alone holds what its last query sees, as after decode steps."""
    model, cfg, dms = tiny_dms(groups, window, c, adapter=adapter is not None,
                               adapter_std=adapter, logit_scale=scale)
    adapter = adapter is not None
    hf, info = export_tiny(model, cfg, dms, tmp_path)
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
    assert config["dms_logit_scale"] == scale and config["dms_channel"] == "last"
    assert config["dms_target_cr"] == 2.0 and "dmc_window" not in config
    assert config["dms_measured_cr"] == info["measured_cr"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dms.DMSLlamaForCausalLM"
    assert info["measured_cr"] > 1.2  # decisions really evict

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert type(hf(ids[:, :5], use_cache=True).past_key_values).__name__ == "DMSCache"
        want = hf(ids).logits
        prefilled = hf(ids, use_cache=True).past_key_values
    torch.testing.assert_close(logits_without_dmc(tmp_path / "hf", ids, tmp_path), want)
    cache = check_hf_logits(hf, model, ids, 25, f"DMS ({groups} groups, window {window})")
    for row in range(2):
        want_held = held_reference(hf, ids[row:row + 1])
        assert torch.equal(cache.slot_counts()[:, row], want_held)
        assert torch.equal(prefilled.slot_counts()[:, row], want_held)
    assert (cache.slot_counts() < 40 - window).any()

    prompts = [ids[0, :11].tolist(), ids[1, :19].tolist()]
    results, out = check_generate_matches_engine(hf, model, prompts, NEW)
    for i, result in enumerate(results):  # the left-padded batch's cache holds the same
        assert torch.equal(out.past_key_values.slot_counts()[:, i].cpu(),
                           result.compression.slots)


def test_beam_search_through_the_dms_cache_equals_beam_search_without_it(tmp_path):
    """Beam search reorders every cache tensor (the marks of keys still in the window
    included): its sequences and scores are those of beam search with full forwards."""
    model, cfg, dms = tiny_dms(2, 3, 0.0)
    hf, _ = export_tiny(model, cfg, dms, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    sequences = check_beam_search_matches_uncached(hf, ids)
    assert len(set(map(tuple, sequences.tolist()))) == 4  # the beams differ
