"""NVIDIA's Megatron-LM DMC checkpoints: a synthetic checkpoint in the legacy layout (TP=2 shards,
nested legacy names, args Namespace with the DMC settings) converts into ours and reproduces the
original model's eval-mode logits exactly; missing or foreign input fails clearly."""
import argparse

import pytest
import torch

from dmc.convert import nvidia_dmc_to_mcore
from dmc.convert.mcore_io import tp_shard
from dmc.inference.loading import load_model
from dmc.megatron.attention import dmc_layers
from dmc.inference import build_model_from_config
from dmc_models import (VOCAB, full_state, megatron_logits, model_config,
                        spread_decisions, tiny_dmc)

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
LEGACY_LAYER = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "pre_mlp_layernorm.weight": "post_attention_norm.weight",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
}
PADDED_VOCAB = VOCAB + 32  # Megatron pads the vocabulary for TP


def legacy_args(cfg, tp, dmc, pp=1):
    return argparse.Namespace(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], group_query_attention=True,
        num_query_groups=cfg["num_query_groups"], ffn_hidden_size=cfg["ffn_hidden_size"],
        max_position_embeddings=cfg["max_seq_length"], seq_length=64, swiglu=True,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        rotary_percent=1.0, untie_embeddings_and_output_weights=True,
        norm_epsilon=cfg.get("norm_epsilon", 1e-5),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        dmc_window_size=dmc["window"], dmc_init_val=dmc["c"], dmc_temp=0.1, dmc_cr=4.0,
        dmc_finetune=True, dmc_is_stage_one=False)


def write_legacy(root, model, cfg, dmc, tp=2, iteration=40, pp=1, **args):
    """Megatron-LM's layout: tracker file, iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt
    (YYY: the pipeline stage when ``pp`` > 1, whose layers are numbered from 0, the embedding on
    the first stage, the final norm and output layer on the last); ``args``: more Megatron-LM
    args (e.g. ``use_rope_scaling=True``)."""
    full = full_state(model)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        pad = torch.randn(PADDED_VOCAB - VOCAB, cfg["hidden_size"])
        full[name] = torch.cat([full[name], pad])
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    per_stage = cfg["num_layers"] // pp
    for rank in range(tp):
        shard = lambda n: tp_shard(n, full[n], rank, tp)  # noqa: E731
        for stage in range(pp):
            encoder = {}
            for name, tensor in full.items():
                if name.startswith("decoder.layers."):
                    _, _, index, rest = name.split(".", 3)
                    local = int(index) - stage * per_stage
                    if 0 <= local < per_stage:
                        encoder[f"layers.{local}.{LEGACY_LAYER[rest]}"] = tp_shard(name, tensor,
                                                                                   rank, tp)
            language_model = {"encoder": encoder}
            if stage == 0:
                language_model["embedding"] = {
                    "word_embeddings": {"weight": shard("embedding.word_embeddings.weight")}}
            if stage == pp - 1:
                encoder["final_norm.weight"] = full["decoder.final_layernorm.weight"]
                language_model["output_layer"] = {"weight": shard("output_layer.weight")}
            name = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            folder = root / f"iter_{iteration:07d}" / name
            folder.mkdir(parents=True)
            namespace = argparse.Namespace(**{**vars(legacy_args(cfg, tp, dmc, pp)), **args})
            torch.save({"args": namespace, "iteration": iteration,
                        "model": {"language_model": language_model}, "checkpoint_version": 3.0},
                       folder / "model_optim_rng.pt")


def test_legacy_tp2_checkpoint_converts_exactly(tmp_path):
    # NVIDIA's models compute omega = sigmoid(q[..., -1] + c) + 2^-7 (bf16 eps)
    model, cfg, dmc = tiny_dmc(groups=2, window=12, c=-1.0, omega_offset=2**-7)
    write_legacy(tmp_path / "nv", model, cfg, dmc)
    info = nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "ours", vocab_size=VOCAB)
    assert info["dmc_config"] == {"window": 12, "tau": 0.1, "c": -1.0, "hard": False,
                                  "hard_loss": True, "prior": "global", "omega_offset": 2**-7}
    loaded = load_model(tmp_path / "ours")
    assert loaded.model_config.vocab_size == VOCAB and loaded.state["target_cr"] == 4.0
    assert loaded.dmc_config.omega_offset == 2**-7
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(4))
    diff = (megatron_logits(loaded.model, ids) - megatron_logits(model, ids)).abs().max().item()
    print(f"max |logit diff| NVIDIA legacy TP=2 -> ours: {diff:.2e}")
    assert diff == 0.0
    assert (tmp_path / "ours" / "model.yaml").is_file()
    dmc_layers(loaded.model)[0].dmc.config.omega_offset = 0.0  # without it the model differs
    unshifted = (megatron_logits(loaded.model, ids) - megatron_logits(model, ids)).abs().max()
    assert unshifted.item() > 1e-4


def test_legacy_tp2_pp2_checkpoint_converts_exactly(tmp_path):
    """A TP=2 x PP=2 source (mp_rank_XX_YYY, 2 layers per stage numbered from 0 on each stage):
    stage p's layer i becomes layer 2p + i, and the converted model's logits equal the
    original's exactly."""
    torch.manual_seed(0)
    cfg = dict(model_config(2), num_layers=4)
    dmc = {"window": 12, "tau": 0.1, "c": -1.0, "hard": False, "omega_offset": 2**-7}
    model = build_model_from_config(cfg, dmc).eval()
    spread_decisions(model)
    write_legacy(tmp_path / "nv", model, cfg, dmc, tp=2, pp=2)
    folder = tmp_path / "nv" / "iter_0000040"
    assert sorted(p.name for p in folder.iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    info = nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "ours", vocab_size=VOCAB)
    assert info["model_config"]["num_layers"] == 4
    loaded = load_model(tmp_path / "ours").model
    original = full_state(model)
    for name, tensor in full_state(loaded).items():
        assert torch.equal(tensor, original[name]), name
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(4))
    assert (megatron_logits(loaded, ids) - megatron_logits(model, ids)).abs().max().item() == 0.0


@pytest.mark.parametrize("args", [{}, {"norm_epsilon": None, "layernorm_epsilon": 1e-6}],
                         ids=["norm_epsilon", "layernorm_epsilon"])
def test_legacy_norm_epsilon_arg_is_carried(tmp_path, args):
    """Megatron-LM's --norm-epsilon 1e-6 (older checkpoints: layernorm_epsilon) becomes the
    converted model's norm_epsilon (not the 1e-5 default), with exact logits."""
    torch.manual_seed(0)
    cfg = dict(model_config(2), norm_epsilon=1e-6)
    dmc = {"window": 12, "tau": 0.1, "c": -1.0, "hard": False, "omega_offset": 2**-7}
    model = build_model_from_config(cfg, dmc).eval()
    write_legacy(tmp_path / "nv", model, cfg, dmc, tp=1, **args)
    info = nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "ours", vocab_size=VOCAB)
    assert info["model_config"]["norm_epsilon"] == 1e-6
    loaded = load_model(tmp_path / "ours")
    assert loaded.model_config.norm_epsilon == 1e-6
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    assert (megatron_logits(loaded.model, ids) - megatron_logits(model, ids)).abs().max() == 0


def test_legacy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration"):
        nvidia_dmc_to_mcore(tmp_path, tmp_path / "out")
    model, cfg, dmc = tiny_dmc(groups=2, window=12)
    write_legacy(tmp_path / "nv", model, cfg, dmc)
    (tmp_path / "nv" / "iter_0000040" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(FileNotFoundError, match="model_optim_rng.pt is missing"):
        nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "out")
    write_legacy(tmp_path / "nv2", model, cfg, dict(dmc))
    path = tmp_path / "nv2" / "iter_0000040" / "mp_rank_00" / "model_optim_rng.pt"
    ckpt = torch.load(path, weights_only=False)
    del ckpt["args"].dmc_window_size
    ckpt["args"].swiglu = False
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match="swiglu must be true.*not a checkpoint of NVIDIA's DMC"):
        nvidia_dmc_to_mcore(tmp_path / "nv2", tmp_path / "out")


@pytest.mark.parametrize("args,factor", [({"use_rope_scaling": True}, 8.0),
                                         ({"use_rope_scaling": True, "rope_scaling_factor": 32.0},
                                          32.0)], ids=["default-factor", "factor-32"])
def test_llama3_rope_scaling_args_convert(tmp_path, args, factor):
    """Megatron-LM's --use-rope-scaling (Llama 3.x scaling, --rope-scaling-factor default 8):
    the converted model scales RoPE as NVIDIA's did."""
    torch.manual_seed(0)
    cfg = dict(model_config(2), rope_scaling_factor=factor)
    dmc = {"window": 12, "tau": 0.1, "c": -1.0, "hard": False, "omega_offset": 2**-7}
    model = build_model_from_config(cfg, dmc).eval()
    write_legacy(tmp_path / "nv", model, cfg, dmc, tp=1, **args)
    info = nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "ours", vocab_size=VOCAB)
    assert info["model_config"]["rope_scaling_factor"] == factor
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    got = megatron_logits(load_model(tmp_path / "ours").model, ids)
    assert (got - megatron_logits(model, ids)).abs().max().item() == 0.0


@pytest.mark.parametrize("args,match", [
    ({"rotary_seq_len_interpolation_factor": 4}, "rotary_seq_len_interpolation_factor=4, "
                                                 "accepted: None, 1"),
    ({"rotary_interleaved": True}, r"rotary_interleaved=True, accepted: False"),
])
def test_rope_args_without_a_counterpart_are_refused(tmp_path, args, match):
    model, cfg, dmc = tiny_dmc(groups=2, window=12)
    write_legacy(tmp_path / "nv", model, cfg, dmc, tp=1, **args)
    with pytest.raises(ValueError, match=match):
        nvidia_dmc_to_mcore(tmp_path / "nv", tmp_path / "ours")
    write_legacy(tmp_path / "ok", model, cfg, dmc, tp=1, rotary_interleaved=False,
                 rotary_seq_len_interpolation_factor=1)
    assert nvidia_dmc_to_mcore(tmp_path / "ok", tmp_path / "ours")["model_config"][
        "rope_scaling_factor"] is None
