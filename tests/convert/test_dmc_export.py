"""DMC export to transformers: the exported folder loads with trust_remote_code, its logits equal
the eval-mode megatron model's, and generate() with its compressed cache produces the greedy
tokens and the per-head slot counts of dmc.inference.Engine (batched, left-padded included);
the tokenizer's bos / eos / pad ids go with the export, so generate() stops at </s>; the export
loads where dmc is not installed."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import mcore_to_hf  # noqa: E402
from dmc_models import (VOCAB, check_beam_search_matches_uncached,  # noqa: E402
                        check_generate_matches_engine, check_hf_logits, export_tiny,
                        logits_without_dmc, megatron_logits, save_tiny, tiny_dmc)

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
    assert config["dmc_measured_cr"] == info["measured_cr"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dmc.DMCLlamaForCausalLM"
    assert info["measured_cr"] > 1.2  # decisions really merge

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids)
    assert type(out.past_key_values).__name__ == "DMCCache"  # config.use_cache default
    torch.testing.assert_close(logits_without_dmc(tmp_path / "hf", ids, tmp_path), out.logits)
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


def test_beam_search_through_the_delayed_merge_cache_equals_beam_search_without_it(tmp_path):
    """Beam search reorders every cache tensor (the raw window's decisions and importances
    included): its sequences and scores are those of beam search with full forwards."""
    model, cfg, dmc = tiny_dmc(2, None, merge_delay=2)
    hf, _ = export_tiny(model, cfg, dmc, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    sequences = check_beam_search_matches_uncached(hf, ids)
    assert len(set(map(tuple, sequences.tolist()))) == 4  # the beams differ


def test_export_carries_the_tokenizers_special_ids(tiny_data, tmp_path):
    """A SentencePiece tokenizer's bos / eos / pad ids go into config.json and a new
    generation_config.json, so the exported model's generate() stops at </s>."""
    model, cfg, dmc = tiny_dmc(2, 4)
    save_tiny(model, cfg, dmc, tmp_path / "mc")
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", tokenizer=tiny_data / "tokenizer.model")
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # dmc.data.tokenizer's
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config.get(k) for k in ids} == ids
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           trust_remote_code=True).eval()
    assert (hf.config.eos_token_id, hf.generation_config.eos_token_id) == (2, 2)

    class ForceEos(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 2] = 1e4
            return scores

    out = hf.generate(torch.tensor([[1, 50, 60]]), max_new_tokens=8, do_sample=False,
                      logits_processor=transformers.LogitsProcessorList([ForceEos()]))
    assert out[0, 3:].tolist() == [2]  # stopped at the end-of-sequence token


def test_special_token_ids_of_a_sentencepiece_model_are_its_bos_eos_and_pad(tiny_data):
    """special_token_ids on a copied tokenizer.model alone: the SentencePiece model's bos / eos /
    pad ids (dmc.data.tokenizer trains 1, 2, 3; unk 0 is not one of them)."""
    from dmc.convert.to_hf import special_token_ids
    from dmc.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    assert (BOS_ID, EOS_ID, PAD_ID, UNK_ID) == (1, 2, 3, 0)
    assert special_token_ids(tiny_data, ["tokenizer.model"]) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def test_export_reads_a_hugging_face_tokenizers_special_ids(tmp_path):
    """A copied HF tokenizer: the ids of the tokens its tokenizer_config.json names, looked up
    in tokenizer.json (added tokens, then the vocabulary), over a conflicting
    special_tokens_map.json (as AutoTokenizer does for a tokenizer_config.json that holds
    added_tokens_decoder, as save_pretrained writes it); its own generation_config.json is
    kept as it is."""
    from dmc.convert.mcore_io import write_checkpoint
    from dmc.inference import build_model_from_config
    from dmc_models import full_state, model_config

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": 7, "content": "<|end|>", "special": True}],
        "model": {"type": "BPE", "vocab": {"<s>": 0, "a": 1, "b": 2}, "merges": []}}))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"7": {"content": "<|end|>", "special": True}},
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|end|>",
        "pad_token": None}))
    (tok / "special_tokens_map.json").write_text(json.dumps({"bos_token": "a",
                                                             "eos_token": {"content": "b"}}))
    (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    torch.manual_seed(0)
    cfg = model_config(2)
    write_checkpoint(tmp_path / "mc", full_state(build_model_from_config(cfg)), cfg, None)
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", tokenizer=tok)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 7)
    assert "pad_token_id" not in config
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [7, 2]}


@pytest.mark.parametrize("decoder", [True, False], ids=["added_tokens_decoder", "older-save"])
@pytest.mark.parametrize("config_pad, mapped", [
    ("<pad>", {"bos_token": "a", "eos_token": {"content": "b"}, "pad_token": "c"}),
    (None, {"pad_token": "c"}), ("<pad>", None)])
def test_special_token_ids_are_those_autotokenizer_reads(tmp_path, decoder, config_pad, mapped):
    """special_token_ids of a Hugging Face tokenizer folder equal AutoTokenizer's bos / eos /
    pad ids, where tokenizer_config.json and special_tokens_map.json disagree: the map is read
    only without added_tokens_decoder, and then wins (a null pad in the config included)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer

    from dmc.convert.to_hf import special_token_ids

    pieces = ["<unk>", "<s>", "</s>", "<pad>", "a", "b", "c"]
    Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": config_pad, "unk_token": "<unk>"}
    if decoder:
        config["added_tokens_decoder"] = {str(i): {"content": p, "special": True}
                                          for i, p in enumerate(pieces[:4])}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if mapped is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(mapped))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    want = {f"{kind}_token_id": getattr(hf, f"{kind}_token_id") for kind in ("bos", "eos", "pad")}
    copied = ["tokenizer.json", "tokenizer_config.json"] + (
        ["special_tokens_map.json"] if mapped is not None else [])
    assert special_token_ids(tmp_path, copied) == {k: v for k, v in want.items() if v is not None}


def test_what_a_compressed_cache_cannot_give_is_refused(tmp_path):
    """Hidden states and attentions are not returned, and assisted or prompt-lookup decoding
    (which cut a cache back) cannot run: each says so instead of returning None or failing
    on a missing method."""
    model, cfg, dmc = tiny_dmc(2, 4)
    hf, _ = export_tiny(model, cfg, dmc, tmp_path)
    ids = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))  # no pad
    for flag in ("output_hidden_states", "output_attentions"):
        with pytest.raises(NotImplementedError, match=f"{flag}: only logits and the cache"):
            hf(ids, **{flag: True})
    with pytest.raises(NotImplementedError, match="cannot be cut back"):
        hf.generate(torch.cat([ids, ids], 1), max_new_tokens=8, do_sample=False,
                    prompt_lookup_num_tokens=3, pad_token_id=0)
