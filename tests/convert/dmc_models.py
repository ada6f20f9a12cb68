"""Tiny DMC megatron checkpoints for the conversion tests."""
import os
import subprocess
import sys

import torch

from dmc.convert.mcore_io import write_checkpoint
from dmc.inference import build_model_from_config
from dmc.megatron.attention import dmc_layers
from tiny_models import decision_rows

VOCAB = 96


def model_config(groups, max_seq=96):
    return dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                ffn_hidden_size=96, vocab_size=VOCAB, max_seq_length=max_seq,
                init_method_std=0.05)


def spread_decisions(model, std=0.4):
    """Redraws the decision rows (q[..., -1], k[..., -1]) with std ``std`` so that the hard
    decisions mix appends and merges."""
    for layer in dmc_layers(model):
        rows = decision_rows(layer)
        with torch.no_grad():
            weight = layer.linear_qkv.weight
            weight[rows] = torch.randn_like(weight[rows]) * std


def tiny_dmc(groups, window, c=-1.0, seed=0, omega_offset=0.0, merge_delay=0):
    """``(model, model_config, dmc_config)``: an eval-mode DMC megatron model."""
    torch.manual_seed(seed)
    cfg = model_config(groups)
    dmc = {"window": window, "tau": 0.1, "c": c, "hard": False, "omega_offset": omega_offset,
           "merge_delay": merge_delay}
    model = build_model_from_config(cfg, dmc).eval()
    spread_decisions(model)
    return model, cfg, dmc


def full_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def save_tiny(model, cfg, dmc, folder, **extra):
    return write_checkpoint(folder, full_state(model), cfg, dmc, extra=extra)


def megatron_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)


def tiny_dms(groups, window, c=0.0, seed=0, adapter=False, adapter_std=0.01, logit_scale=None):
    """``(model, model_config, dmc_config)``: an eval-mode DMS megatron model (hard decisions;
    the borrowed channel's logit ``q[..., -1] * 100 - c`` mixes keeps and evictions).
    ``adapter``: adapter decisions (``dms_decision: adapter``), ``decision_proj`` of std
    ``adapter_std``; ``logit_scale``: ``dms_logit_scale`` (None: the default, 100)."""
    torch.manual_seed(seed)
    cfg = model_config(groups)
    dms = {"method": "dms", "dms_window": window, "c": c, "tau": 0.1, "hard": False}
    if adapter:
        dms["dms_decision"] = "adapter"
    if logit_scale is not None:
        dms["dms_logit_scale"] = logit_scale
    model = build_model_from_config(cfg, dms).eval()
    for layer in dmc_layers(model) if adapter else ():
        with torch.no_grad():
            layer.decision_proj.weight.normal_(0.0, adapter_std)
    return model, cfg, dms


def check_hf_roundtrip(hf, hf_dir, tmp_path, ids):
    """Converts the saved ``hf`` folder ``hf_dir`` to megatron (``tmp_path / "mc"``): our logits
    equal HF's to 1e-5; back to HF (``tmp_path / "back"``): every tensor bit-identical and the
    reloaded model's logits equal. Returns ``(hf_to_mcore's info, the exported config.json)``."""
    import json

    import transformers
    from safetensors.torch import load_file

    from dmc.convert import hf_to_mcore, mcore_to_hf
    from dmc.convert.hf_io import read_hf_weights
    from dmc.inference.loading import load_model

    info = hf_to_mcore(hf_dir, tmp_path / "mc")
    with torch.no_grad():
        want = hf(ids).logits
    got = megatron_logits(load_model(tmp_path / "mc").model, ids)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| HF {type(hf).__name__} vs megatron: {diff:.2e}")
    assert diff < 1e-5
    mcore_to_hf(tmp_path / "mc", tmp_path / "back")
    original = read_hf_weights(hf_dir)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, want)
    return info, json.loads((tmp_path / "back" / "config.json").read_text())


def export_tiny(model, cfg, dmc, tmp_path):
    """Saves the tiny model (``tmp_path / "mc"``), exports it to transformers (``tmp_path /
    "hf"``, the CR measured on a fixed 48-token sample) and loads it with trust_remote_code.
    Returns ``(the HF model, mcore_to_hf's info)``."""
    import transformers

    from dmc.convert import mcore_to_hf

    save_tiny(model, cfg, dmc, tmp_path / "mc", target_cr=2.0)
    sample = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    info = mcore_to_hf(tmp_path / "mc", tmp_path / "hf", cr_tokens=sample)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           trust_remote_code=True).eval()
    return hf, info


WITHOUT_DMC = """
import importlib.abc, sys

class NoDmc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dmc" or name.startswith("dmc."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoDmc())
import torch, transformers
folder, ids, out = sys.argv[1:]
hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(hf(torch.load(ids)).logits, out)
"""


def logits_without_dmc(folder, ids, tmp_path):
    """The logits of ``ids`` from the export at ``folder`` loaded where ``dmc`` cannot be
    imported (a user with transformers alone: the export must carry every file its code
    imports), in a subprocess."""
    script, ids_file, out = tmp_path / "without_dmc.py", tmp_path / "ids.pt", tmp_path / "out.pt"
    script.write_text(WITHOUT_DMC)
    torch.save(ids, ids_file)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf_modules"), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script), str(folder), str(ids_file), str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def check_hf_logits(hf, model, ids, prefix, label):
    """The HF model's logits on ``ids [batch, n]`` equal the megatron ``model``'s to 1e-5, both
    from one full forward and teacher-forced through its compressed cache (``prefix`` tokens,
    then one at a time, the last with ``use_cache=False``). Returns the cache after the last
    token."""
    want = megatron_logits(model, ids)
    with torch.no_grad():
        got = hf(ids, use_cache=False).logits
        cached = hf(ids[:, :prefix], use_cache=True)
        steps, cache = [cached.logits], cached.past_key_values
        for t in range(prefix, ids.shape[1] - 1):
            out = hf(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
        out = hf(ids[:, -1:], past_key_values=cache, use_cache=False)  # as Llama's: a cache
        steps.append(out.logits)  # given is read and extended whatever use_cache says
        cache = out.past_key_values
    diff = (got - want).abs().max().item()
    diff_cache = (torch.cat(steps, dim=1) - want).abs().max().item()
    print(f"max |logit diff| HF {label} vs megatron eval: {diff:.2e}; through the HF cache: "
          f"{diff_cache:.2e}")
    assert diff < 1e-5 and diff_cache < 1e-5
    return cache


def check_generate_matches_engine(hf, model, prompts, new):
    """generate() (greedy, ``new`` tokens) of each prompt alone gives dmc.inference.Engine's
    tokens and per-head slot counts, and of the left-padded batch the same tokens. Returns the
    engine's results and the batch's generate() output."""
    from dmc.inference import Engine, SamplingParams

    engine = Engine(model, max_batch=len(prompts), max_seq_len=64)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=new))
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        assert out.sequences[0, len(prompt):].tolist() == result.tokens
        slots = out.past_key_values.slot_counts()[:, 0]  # [layers, kv_heads]
        assert torch.equal(slots.cpu(), result.compression.slots)
    width = max(map(len, prompts))
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True)
    for i, result in enumerate(results):
        assert out.sequences[i, width:].tolist() == result.tokens
    return results, out


def check_beam_search_matches_uncached(hf, ids, new=20, beams=4):
    """Beam search (``beams`` beams, ``new`` tokens) of ``ids [1, n]`` through the compressed
    cache, whose layers beam search reorders every step (``reorder_cache``), gives the tokens
    of beam search with ``use_cache=False`` (each step one full forward, float64) and its
    sequence scores to 1e-5. Returns the cached run's sequences ``[beams, n + new]``."""
    hf = hf.double()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, num_beams=beams,
                  num_return_sequences=beams, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cached = hf.generate(ids, use_cache=True, **kwargs)
        full = hf.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.sequences_scores, full.sequences_scores, atol=1e-5,
                               rtol=0)
    return cached.sequences
