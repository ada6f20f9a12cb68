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
from dmc_models import VOCAB, full_state, megatron_logits, model_config, tiny_dmc

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


def legacy_args(cfg, tp, dmc):
    return argparse.Namespace(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], group_query_attention=True,
        num_query_groups=cfg["num_query_groups"], ffn_hidden_size=cfg["ffn_hidden_size"],
        max_position_embeddings=cfg["max_seq_length"], seq_length=64, swiglu=True,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        rotary_percent=1.0, untie_embeddings_and_output_weights=True, norm_epsilon=1e-5,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        dmc_window_size=dmc["window"], dmc_init_val=dmc["c"], dmc_temp=0.1, dmc_cr=4.0,
        dmc_finetune=True, dmc_is_stage_one=False)


def write_legacy(root, model, cfg, dmc, tp=2, iteration=40, **args):
    """Megatron-LM's layout: tracker file, iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt;
    ``args``: more Megatron-LM args (e.g. ``use_rope_scaling=True``)."""
    full = full_state(model)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        pad = torch.randn(PADDED_VOCAB - VOCAB, cfg["hidden_size"])
        full[name] = torch.cat([full[name], pad])
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    for rank in range(tp):
        encoder = {"final_norm.weight": full["decoder.final_layernorm.weight"]}
        for name, tensor in full.items():
            if name.startswith("decoder.layers."):
                _, _, index, rest = name.split(".", 3)
                encoder[f"layers.{index}.{LEGACY_LAYER[rest]}"] = tp_shard(name, tensor, rank, tp)
        shard = lambda n: tp_shard(n, full[n], rank, tp)  # noqa: E731
        model_sd = {"language_model": {
            "embedding": {"word_embeddings": {"weight": shard("embedding.word_embeddings.weight")}},
            "encoder": encoder,
            "output_layer": {"weight": shard("output_layer.weight")},
        }}
        folder = root / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        namespace = argparse.Namespace(**vars(legacy_args(cfg, tp, dmc)), **args)
        torch.save({"args": namespace, "iteration": iteration,
                    "model": model_sd, "checkpoint_version": 3.0},
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
