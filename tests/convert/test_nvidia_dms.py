"""NVIDIA Model-Optimizer DMS checkpoints (Hugging Face Qwen3 + ``dms_*`` config fields) -> ours,
in both decision modes: a tiny fake checkpoint converts; the eval model (hard decisions) equals
a float64 reference of NVIDIA's forward (borrowed channel: q_norm -> logit from the first query
head of each KV group -> zero that channel -> RoPE -> zero again; separate adapter: logit from
``dms_proj_alpha(dms_proj_alpha_norm(h))`` of the layer input, query untouched; then delayed
eviction, window ``dms_window_size`` exactly); the paged engine's greedy decode equals the eval
model and holds NVIDIA's survivors; a TP=2 save loads; each unsupported setting fails naming its
field (CLI exit code 2); ``dms_disable_eviction`` keeps the borrowed channel zeroed (DMS that
never evicts) or, with the adapter, converts as a plain Qwen3."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.cli import main  # noqa: E402
from dmc.convert import UnsupportedModelError, nvidia_dms_to_mcore  # noqa: E402
from dmc.convert.hf_io import WEIGHT_FILES, WEIGHT_INDEXES, read_hf_weights  # noqa: E402
from dmc.convert.hf_io import write_safetensors  # noqa: E402
from dmc.convert.nvidia_dms import NEVER_EVICT_C  # noqa: E402
from dmc.inference import Engine, SamplingParams  # noqa: E402
from dmc.inference.loading import load_model  # noqa: E402
from dmc.training.config import load_config  # noqa: E402
from dmc_models import megatron_logits  # noqa: E402
from qwen3_reference import RefConfig, RefDMS, reference_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
VOCAB, WINDOW = 80, 4
DMS_FIELDS = {"dms_alpha_scale": 100.0, "dms_initial_alpha_offset": 5.0,
              "dms_window_size": WINDOW, "dms_paged_attention_block_size": 2, "dms_cr": 8,
              "dms_disable_eviction": False, "dms_separate_alpha": False, "dms_alpha_per": "head",
              "dms_tau": 0.1, "dms_compile_limit": 72, "dms_manual_inference_mode": False,
              "dms_chunked_prefill": None, "dms_preallocate_for_tokens": 4096}
REF = RefConfig(heads=4, groups=2, head_dim=16, eps=1e-6, theta=1e6)


def fake_nvidia_dms(folder, shard=None, **fields):
    """Writes a tiny random Qwen3 (hidden 48, 4 heads of head_dim 16 in 2 KV groups) as an
    NVIDIA DMS folder: ``config.json`` with the dms_* fields, safetensors, a tokenizer file.
    Random q_norm weights make ``q_norm(q)[..., -1] * 100 - 5`` about half positive."""
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1e6, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    config = json.loads((folder / "config.json").read_text())
    config.update(DMS_FIELDS, architectures=["Qwen3ForCausalLMDMS"],
                  auto_map={"AutoConfig": "configuration_qwen3_dms.Qwen3ConfigDMS"})
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    if config["dms_separate_alpha"]:
        add_separate_alpha(folder, shard)


def add_separate_alpha(folder, shard=None):
    """Adds NVIDIA's per-layer adapter of ``dms_separate_alpha: true``: ``dms_proj_alpha_norm``
    (weights around 1, unlike the input norm's) and ``dms_proj_alpha [kv_heads, hidden]``
    (std 0.02: logits ``* 100 - 5`` about a third positive)."""
    state = read_hf_weights(folder)
    for name in WEIGHT_FILES + WEIGHT_INDEXES:
        (folder / name).unlink(missing_ok=True)
    for path in folder.glob("model-*.safetensors"):
        path.unlink()
    gen = torch.Generator().manual_seed(7)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        state[p + "dms_proj_alpha_norm.weight"] = 1 + 0.3 * torch.randn(48, generator=gen)
        state[p + "dms_proj_alpha.weight"] = 0.02 * torch.randn(2, 48, generator=gen)
    write_safetensors(folder, state, 30_000 if shard else 1 << 30)


def ref_dms(separate, offset=5.0, window=WINDOW):
    """NVIDIA's settings of :data:`DMS_FIELDS` for the reference."""
    return RefDMS(100.0, offset, window, separate)


MODES = [False, True]
MODE_IDS = ["borrowed-channel", "separate-alpha"]


@pytest.mark.parametrize("separate", MODES, ids=MODE_IDS)
def test_converted_model_equals_nvidia_reference_and_engine(tmp_path, separate):
    fake_nvidia_dms(tmp_path / "nv", shard="30KB", dms_separate_alpha=separate)
    assert (tmp_path / "nv" / "model.safetensors.index.json").is_file()
    info = nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc")
    dms = info["dmc_config"]
    assert (dms["method"], dms["dms_window"], dms["dms_logit_scale"], dms["c"], dms["tau"]) == (
        "dms", WINDOW, 100.0, 5.0, 0.1)
    assert dms.get("dms_decision", "query") == ("adapter" if separate else "query")
    assert dms["hard_loss"] is True and "tokenizer.json" in info["tokenizer"]
    state = json.loads((tmp_path / "mc" / "state.json").read_text())
    assert state["target_cr"] == 8.0 and state["source"]["format"] == "nvidia-dms"
    cfg = load_config([info["yaml"]], ["data.path=x", "data.seq_length=32"])
    assert cfg.model.qk_layernorm and cfg.model.kv_channels == 16

    model = load_model(tmp_path / "mc").model
    weights = read_hf_weights(tmp_path / "nv")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    got = megatron_logits(model, ids).double()
    for row in range(2):
        want = reference_logits(weights, REF, ids[row], ref_dms(separate))
        diff = (got[row] - want).abs().max().item()
        print(f"max |logit diff| converted eval model vs NVIDIA reference: {diff:.2e}")
        assert diff < 1e-4
        # the window is converted exactly: one more or one less gives other logits
        for other in (WINDOW - 1, WINDOW + 1):
            shifted = reference_logits(weights, REF, ids[row], ref_dms(separate, window=other))
            assert (got[row] - shifted).abs().max() > 1e-3
        kept_all = reference_logits(weights, REF, ids[row], ref_dms(separate, offset=1e9))
        assert (got[row] - kept_all).abs().max() > 1e-2  # tokens really are evicted

    prompts = [ids[0, :9].tolist(), ids[1, :17].tolist()]
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=5)
    assert engine.dmc is not None and engine.dmc.method == "dms"
    results = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    for prompt, result in zip(prompts, results):
        fed = prompt + result.tokens[:-1]  # the last generated token is never fed back
        logp = megatron_logits(model, torch.tensor([fed]))[0].double().log_softmax(-1)
        steps = logp[len(prompt) - 1:]
        assert steps.argmax(-1).tolist() == result.tokens  # teacher-forced greedy
        picked = steps.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), picked,
                                   atol=1e-4, rtol=0)
        marks, n = [], len(fed)
        reference_logits(weights, REF, torch.tensor(fed), ref_dms(separate), marks)
        gone = torch.stack(marks) & (n - 1 - torch.arange(n) > WINDOW)  # [layers, groups, n]
        assert torch.equal(result.compression.slots, n - gone.sum(-1))  # NVIDIA's evictions
        assert result.compression.overall > 1.2


@pytest.mark.parametrize("separate", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=MODE_IDS)
def test_tp2_save(tmp_path, separate):
    fake_nvidia_dms(tmp_path / "nv", dms_separate_alpha=separate)
    nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc", tp=2)
    assert json.loads((tmp_path / "mc" / "state.json").read_text())["tp"] == 2
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    got = megatron_logits(load_model(tmp_path / "mc").model, ids)[0].double()
    want = reference_logits(read_hf_weights(tmp_path / "nv"), REF, ids[0],
                            ref_dms(separate))
    assert (got - want).abs().max() < 1e-4


def test_disable_eviction_keeps_the_borrowed_channel_zeroed(tmp_path, capsys):
    """Borrowed channel, eviction disabled: NVIDIA still zeroes q[first head of group, -1]
    before and after RoPE and only forces the decisions to 0, so the converted model is DMS
    whose logits never fire (an offset of inf in the reference), not a plain Qwen3."""
    fake_nvidia_dms(tmp_path / "nv", dms_disable_eviction=True)
    assert main(["convert", "nvidia-dms", str(tmp_path / "nv"), str(tmp_path / "mc")]) == 0
    assert "decisions never fire" in capsys.readouterr().out
    loaded = load_model(tmp_path / "mc")
    assert loaded.dmc_config.method == "dms" and loaded.dmc_config.c == NEVER_EVICT_C
    assert loaded.state["target_cr"] is None
    weights = read_hf_weights(tmp_path / "nv")
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    got = megatron_logits(loaded.model, ids)[0].double()
    want = reference_logits(weights, REF, ids[0], ref_dms(False, offset=float("inf")))
    assert (got - want).abs().max() < 1e-4
    assert (got - reference_logits(weights, REF, ids[0])).abs().max() > 1e-2  # not vanilla
    result = Engine(loaded.model, page_size=4, max_batch=1).generate(
        [ids[0, :17].tolist()], SamplingParams(max_new_tokens=6))[0]
    assert result.compression.overall == 1.0  # nothing evicted


def test_disable_eviction_needs_logits_the_offset_cannot_reach(tmp_path):
    fake_nvidia_dms(tmp_path / "nv", dms_disable_eviction=True)
    state = read_hf_weights(tmp_path / "nv")
    state["model.layers.1.self_attn.q_norm.weight"][-1] = 1e7  # |logit| up to 4e9
    (tmp_path / "nv" / "model.safetensors").unlink()
    write_safetensors(tmp_path / "nv", state, 1 << 30)
    with pytest.raises(UnsupportedModelError, match="dms_disable_eviction=true: layer 1"):
        nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc")


def test_disable_eviction_with_the_adapter_converts_as_vanilla(tmp_path):
    """Separate adapter, eviction disabled: the query keeps every channel, so the model is a
    plain Qwen3 and the adapter is dropped."""
    fake_nvidia_dms(tmp_path / "nv", dms_disable_eviction=True, dms_separate_alpha=True)
    info = nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc")
    assert "dmc_config" not in info and "vanilla" in info["note"]
    loaded = load_model(tmp_path / "mc")
    assert loaded.dmc_config is None and loaded.model_config.qk_layernorm
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    want = reference_logits(read_hf_weights(tmp_path / "nv"), REF, ids[0])
    assert (megatron_logits(loaded.model, ids)[0].double() - want).abs().max() < 1e-4


def test_separate_alpha_needs_a_nonzero_input_norm(tmp_path, capsys):
    fake_nvidia_dms(tmp_path / "nv", dms_separate_alpha=True)
    state = read_hf_weights(tmp_path / "nv")
    state["model.layers.1.input_layernorm.weight"][5] = 0
    (tmp_path / "nv" / "model.safetensors").unlink()
    write_safetensors(tmp_path / "nv", state, 1 << 30)
    with pytest.raises(UnsupportedModelError, match="layer 1: input_layernorm.weight has zeros"):
        nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc")
    assert main(["convert", "nvidia-dms", str(tmp_path / "nv"), str(tmp_path / "mc2")]) == 2


@pytest.mark.parametrize("fields,match", [
    ({"dms_separate_alpha": "yes"}, r"dms_separate_alpha='yes' is not supported; accepted: "
                                    r"\[False, True\]"),
    ({"dms_alpha_per": "layer"}, r"dms_alpha_per='layer' is not supported; accepted: \['head'\]"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "architecture"),
    ({"dms_window_size": -1}, "dmc.dms_window"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_rejected_settings(tmp_path, capsys, fields, match):
    fake_nvidia_dms(tmp_path / "nv", **fields)
    with pytest.raises(UnsupportedModelError, match=match):
        nvidia_dms_to_mcore(tmp_path / "nv", tmp_path / "mc")
    assert main(["convert", "nvidia-dms", str(tmp_path / "nv"), str(tmp_path / "mc2")]) == 2
    assert "error" in capsys.readouterr().err


def test_not_a_dms_folder(tmp_path, capsys):
    fake_nvidia_dms(tmp_path / "nv")
    path = tmp_path / "nv" / "config.json"
    plain = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("dms_")}
    path.write_text(json.dumps(plain))
    assert main(["convert", "nvidia-dms", str(tmp_path / "nv"), str(tmp_path / "mc")]) == 2
    assert "not an NVIDIA DMS checkpoint" in capsys.readouterr().err
    assert main(["convert", "nvidia-dms", str(tmp_path / "none"), str(tmp_path / "mc")]) == 2
