"""DMC export to transformers: the exported folder loads with trust_remote_code, its logits equal
the eval-mode megatron model's, and generate() with its compressed cache produces the greedy
tokens and the per-head slot counts of dmc.inference.Engine (batched, left-padded included)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import mcore_to_hf  # noqa: E402
from dmc_models import (VOCAB, check_generate_matches_engine, check_hf_logits,  # noqa: E402
                        export_tiny, megatron_logits, tiny_dmc)

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
NEW = 16


@pytest.mark.parametrize("groups,window,omega_offset", [(2, 4, 2**-7), (4, None, 0.0)],
                         ids=["gqa-window4-nvidia-offset", "mha-exact"])
def test_exported_dmc_model_matches_megatron_and_engine(tmp_path, groups, window, omega_offset):
    model, cfg, dmc = tiny_dmc(groups, window, omega_offset=omega_offset)
    hf, info = export_tiny(model, cfg, dmc, tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dmc_window"] == window and config["dmc_c"] == -1.0
    assert config["dmc_omega_offset"] == omega_offset
    assert config["dmc_channel"] == "last" and config["dmc_target_cr"] == 2.0
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dmc.DMCLlamaForCausalLM"
    assert info["measured_cr"] > 1.2  # decisions really merge

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert type(hf(ids).past_key_values).__name__ == "DMCCache"  # config.use_cache default
    cache = check_hf_logits(hf, model, ids, 25, f"DMC ({groups} groups, window {window})")
    assert (cache.slot_counts() < 40).any()
    check_generate_matches_engine(hf, model, [ids[0, :11].tolist(), ids[1, :19].tolist()], NEW)


def test_vanilla_checkpoint_exports_as_llama(tmp_path):
    from dmc.convert.mcore_io import write_checkpoint
    from dmc_models import full_state, model_config
    from dmc.inference import build_model_from_config

    torch.manual_seed(0)
    cfg = model_config(2)
    model = build_model_from_config(cfg).eval()
    write_checkpoint(tmp_path / "mc", full_state(model), cfg, None)
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(ids).logits - megatron_logits(model, ids)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("groups,window,delay", [(2, 4, 5), (4, None, 1)],
                         ids=["gqa-window4-delay5", "mha-exact-delay1"])
def test_exported_delayed_merge_model_matches_megatron_and_engine(tmp_path, groups, window,
                                                                   delay):
    """DMC with delayed merging: logits of a full forward and through the cache (the prefix
    shorter and longer than the raw window) equal megatron's; generate() gives the engine's
    tokens and slots (Algorithm 1's plus the raw window), left-padded batches included."""
    model, cfg, dmc = tiny_dmc(groups, window, merge_delay=delay)
    hf, info = export_tiny(model, cfg, dmc, tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dmc_merge_delay"] == delay and config["dmc_window"] == window
    assert info["measured_cr"] > 1.2
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    for prefix in (3, 25):
        cache = check_hf_logits(hf, model, ids, prefix, f"delay {delay}, prefix {prefix}")
        assert (cache.slot_counts() < 40).any()
    results, _ = check_generate_matches_engine(
        hf, model, [ids[0, :3].tolist(), ids[1, :19].tolist(), ids[0, 5:30].tolist()], NEW)
    assert max(r.compression.overall for r in results) > 1.1
