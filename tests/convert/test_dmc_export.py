"""DMC export to transformers: the exported folder loads with trust_remote_code, its logits equal
the eval-mode megatron model's, and generate() with its compressed cache produces the greedy
tokens and the per-head slot counts of dmc.inference.Engine (batched, left-padded included)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import mcore_to_hf  # noqa: E402
from dmc.inference import Engine, SamplingParams  # noqa: E402
from dmc_models import VOCAB, megatron_logits, save_tiny, tiny_dmc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
NEW = 16


def export(tmp_path, groups, window, omega_offset=0.0):
    model, cfg, dmc = tiny_dmc(groups, window, omega_offset=omega_offset)
    save_tiny(model, cfg, dmc, tmp_path / "mc", target_cr=2.0)
    sample = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    info = mcore_to_hf(tmp_path / "mc", tmp_path / "hf", cr_tokens=sample)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           trust_remote_code=True).eval()
    return model, hf, info


@pytest.mark.parametrize("groups,window,omega_offset", [(2, 4, 2**-7), (4, None, 0.0)],
                         ids=["gqa-window4-nvidia-offset", "mha-exact"])
def test_exported_dmc_model_matches_megatron_and_engine(tmp_path, groups, window, omega_offset):
    model, hf, info = export(tmp_path, groups, window, omega_offset)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dmc_window"] == window and config["dmc_c"] == -1.0
    assert config["dmc_omega_offset"] == omega_offset
    assert config["dmc_channel"] == "last" and config["dmc_target_cr"] == 2.0
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dmc.DMCLlamaForCausalLM"
    assert info["measured_cr"] > 1.2  # decisions really merge

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    want = megatron_logits(model, ids)
    with torch.no_grad():
        got = hf(ids, use_cache=False).logits
        assert type(hf(ids).past_key_values).__name__ == "DMCCache"  # config.use_cache default
        cached = hf(ids[:, :25], use_cache=True)
        steps = [cached.logits]
        cache = cached.past_key_values
        for t in range(25, 40):  # teacher forcing through the compressed cache
            out = hf(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    diff = (got - want).abs().max().item()
    diff_cache = (torch.cat(steps, dim=1) - want).abs().max().item()
    print(f"max |logit diff| HF DMC vs megatron eval ({groups} groups, window {window}): "
          f"{diff:.2e}; through the HF cache: {diff_cache:.2e}")
    assert diff < 1e-5 and diff_cache < 1e-5
    assert (cache.slot_counts() < 40).any()

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
                      pad_token_id=0)
    for i, result in enumerate(results):
        assert out[i, width:].tolist() == result.tokens


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
