"""MHA -> GQA by mean-pooling K/V heads (Ainslie et al.) and the vanilla up-training run."""
import json

import pytest
import torch

from dmc.baselines import convert_to_gqa, pool_qkv
from dmc.cli import main
from dmc.inference import Engine, save_inference_state
from dmc.inference.loading import load_model
from dmc.megatron.model import build_gpt_model
from dmc.megatron import checkpoint as ckpt
from dmc.training.config import load_config
from dmc.training.trainer import Trainer
from tiny_models import VOCAB, build_tiny, tiny_config

from conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS, DIM, HIDDEN = 4, 16, 64


def reference_pool(weight, heads, old, new, dim):
    """Float64 per-head reference: new group j gets query heads j*heads/new.. unchanged and the
    mean of the K (V) heads of the old groups j*old/new .. (j+1)*old/new - 1."""
    weight = weight.double()
    per_old, per_new, r = heads // old, heads // new, old // new

    def rows(group, slot):  # slot < per_old: query head, per_old: k, per_old + 1: v
        start = (group * (per_old + 2) + slot) * dim
        return weight[start:start + dim]

    blocks = []
    for j in range(new):
        for h in range(j * per_new, (j + 1) * per_new):
            blocks.append(rows(h // per_old, h % per_old))
        for slot in (per_old, per_old + 1):
            blocks.append(sum(rows(g, slot) for g in range(j * r, (j + 1) * r)) / r)
    return torch.cat(blocks)


@pytest.mark.parametrize("heads,old,new", [(4, 4, 2), (4, 4, 1), (8, 4, 2), (8, 8, 2)])
def test_pool_matches_float64_reference(heads, old, new):
    gen = torch.Generator().manual_seed(heads * 10 + old + new)
    weight = torch.randn(old * (heads // old + 2) * DIM, 24, generator=gen)
    got = pool_qkv(weight, heads, old, new)
    assert got.shape == (new * (heads // new + 2) * DIM, 24)
    torch.testing.assert_close(got.double(), reference_pool(weight, heads, old, new, DIM),
                               rtol=0, atol=1e-6)
    bias = weight[:, 0].clone()
    torch.testing.assert_close(pool_qkv(bias, heads, old, new).double(),
                               reference_pool(bias[:, None], heads, old, new, DIM)[:, 0],
                               rtol=0, atol=1e-6)


def test_pool_with_same_groups_is_identity():
    weight = torch.randn(4 * 3 * DIM, 8)
    assert torch.equal(pool_qkv(weight, 8, 4, 4), weight)


def test_pool_rejects_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="must divide"):
        pool_qkv(torch.randn(4 * 3 * DIM, 8), 4, 4, 3)


@pytest.fixture(scope="module")
def mha_file(parallel_1x1, tmp_path_factory):
    """A vanilla 4-head MHA model saved as an inference file, and the model."""
    model, _ = build_tiny(4, seed=7)
    path = tmp_path_factory.mktemp("mha") / "mha.pt"
    config = {"num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
              "num_query_groups": 4, "ffn_hidden_size": 96, "vocab_size": VOCAB,
              "max_seq_length": 160}
    save_inference_state(path, model, config)
    return path, model


def hand_built_gqa(mha, groups):
    """A GQA model whose weights are set head by head from ``mha`` (q, k, v split explicitly)."""
    torch.manual_seed(1)
    gqa = build_gpt_model(tiny_config(groups), VOCAB, 160)
    state = dict(mha.state_dict())
    per = HEADS // groups
    for name, weight in mha.state_dict().items():
        if not name.endswith("linear_qkv.weight"):
            continue
        heads = weight.reshape(HEADS, 3, DIM, HIDDEN)  # MHA: group h = [q_h, k_h, v_h]
        q, k, v = heads[:, 0], heads[:, 1], heads[:, 2]
        blocks = []
        for g in range(groups):
            members = range(g * per, (g + 1) * per)
            blocks += [q[h] for h in members]
            blocks += [k[list(members)].mean(0), v[list(members)].mean(0)]
        state[name] = torch.cat(blocks)
    gqa.load_state_dict(state)
    return gqa


@pytest.mark.parametrize("groups", [2, 1])
def test_converted_model_equals_hand_built_gqa(mha_file, tmp_path, groups):
    path, mha = mha_file
    out = convert_to_gqa(path, groups, tmp_path / "gqa")
    state = json.loads((out / "state.json").read_text())
    assert state["model_config"]["num_query_groups"] == groups and state["dmc_config"] is None
    loaded = load_model(out)
    converted, reference = loaded.model.eval(), hand_built_gqa(mha, groups).eval()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids, pos, None), reference(ids, pos, None),
                                   rtol=1e-5, atol=1e-5)
    for name, weight in mha.state_dict().items():  # everything but linear_qkv is copied
        if isinstance(weight, torch.Tensor) and "linear_qkv.weight" not in name:
            assert torch.equal(loaded.model.state_dict()[name], weight), name
    engine = Engine(loaded.model, dmc=None, max_batch=1, max_seq_len=64)
    assert engine.num_kv_heads == groups
    assert engine.score(ids[0].tolist()).token_logprobs.shape == (39,)


@pytest.mark.parametrize("groups, factor", [(2, 2), (1, 4)])
def test_cli_suggests_the_recipe_of_the_factor_converted(mha_file, tmp_path, capsys, groups,
                                                         factor):
    path, _ = mha_file
    assert main(["baseline", "gqa", "--checkpoint", str(path), "--num-query-groups",
                 str(groups), "--output", str(tmp_path / "gqa")]) == 0
    out = capsys.readouterr().out
    assert f"({factor}x fewer than the source's {HEADS})" in out
    assert (f"--config configs/retrofit/gqa{factor}.yaml model.num_query_groups={groups} "
            f"checkpoint.load_base={tmp_path / 'gqa'}") in out
    assert out.count("configs/retrofit/gqa") == 1


def test_convert_errors_name_the_flag(mha_file, tmp_path):
    path, _ = mha_file
    with pytest.raises(ValueError, match=r"--num-query-groups must divide.*accepted: \[1, 2, 4\]"):
        convert_to_gqa(path, 3, tmp_path / "x")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="--output .* already exists"):
        convert_to_gqa(path, 2, tmp_path / "exists")
    done = convert_to_gqa(path, 2, tmp_path / "done")  # a requeued job: the same conversion
    written = (done / "state.json").stat().st_mtime_ns
    assert convert_to_gqa(path, 2, done) == done
    assert (done / "state.json").stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="--output .* already exists"):
        convert_to_gqa(path, 1, done)


def test_an_output_holding_another_checkpoints_conversion_is_refused(mha_file, tmp_path):
    """--output holding the conversion of another --checkpoint (same KV heads) is not taken
    for this one's: the call raises and leaves the folder as it was."""
    path, _ = mha_file
    other, _ = build_tiny(4, seed=8)
    other_path = tmp_path / "other.pt"
    save_inference_state(other_path, other, {
        "num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "num_query_groups": 4, "ffn_hidden_size": 96, "vocab_size": VOCAB,
        "max_seq_length": 160})
    done = convert_to_gqa(path, 2, tmp_path / "gqa")
    written = (done / "state.json").read_text()
    with pytest.raises(ValueError, match="--output .* already exists .*no conversion of "
                                         ".*other.pt to 2 KV heads"):
        convert_to_gqa(other_path, 2, done)
    assert (done / "state.json").read_text() == written
    assert json.loads(written)["source"] == str(path)


def test_convert_rejects_dmc_model(parallel_1x1, tmp_path):
    model, _ = build_tiny(2, window=3)
    path = tmp_path / "dmc.pt"
    save_inference_state(path, model, {"num_layers": 2, "hidden_size": HIDDEN,
                                       "num_attention_heads": HEADS, "num_query_groups": 2,
                                       "ffn_hidden_size": 96, "vocab_size": VOCAB,
                                       "max_seq_length": 160}, {"window": 3, "c": -1.0})
    with pytest.raises(ValueError, match="is a DMC model"):
        convert_to_gqa(path, 1, tmp_path / "out")


def test_gqa_uptraining_from_a_converted_pretrain_run(tiny_data, tmp_path, capsys):
    """pretrain (2 KV heads) -> `dmc baseline gqa` (1 KV head) -> configs/retrofit/gqa2.yaml
    up-training: vanilla steps from the converted weights, a clear error on a shape mismatch."""
    base_cfg = load_config([], tiny_overrides(tiny_data, tmp_path / "base",
                                              **{"schedule.pretrain_steps": 2}))
    Trainer(base_cfg, "pretrain").run()
    base = tmp_path / "base" / "checkpoints" / "pretrain"
    assert main(["baseline", "gqa", "--checkpoint", str(base), "--num-query-groups", "1",
                 "--output", str(tmp_path / "gqa"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_query_groups"] == 1
    converted_state = json.loads((tmp_path / "gqa" / "state.json").read_text())
    assert json.loads((base / "state.json").read_text())["config"]["model"][
        "num_query_groups"] == 2
    assert converted_state["model_config"]["num_query_groups"] == 1
    assert converted_state["config"]["model"]["num_query_groups"] == 1  # the training config too

    def uptrain_cfg(**extra):
        values = {"checkpoint.load_base": tmp_path / "gqa", "schedule.zero_out_steps": 1,
                  "schedule.retrofit_steps": 1, "schedule.solidify_steps": 2, **extra}
        return load_config(["configs/retrofit/gqa2.yaml"],
                           tiny_overrides(tiny_data, tmp_path / "up", **values))

    with pytest.raises(ValueError, match="model.num_query_groups is 2 but the checkpoint has 1"
                                         ".*model.num_query_groups=1"):
        Trainer(uptrain_cfg(), "retrofit")
    trainer = Trainer(uptrain_cfg(**{"model.num_query_groups": 1}), "retrofit")
    converted = load_model(tmp_path / "gqa").model.state_dict()
    for name, weight in trainer.module.state_dict().items():
        if isinstance(weight, torch.Tensor):
            assert torch.equal(weight, converted[name]), name
    results = trainer.run()
    assert [r.phase for r in results] == ["uptrain", "uptrain", "solidify", "solidify"]
    assert all(r.target_cr == 1.0 and r.cr_loss == 0.0 for r in results)
    assert results[-1].lr < results[0].lr  # cosine during solidify, as in the DMC recipe
    assert "valid_cr" not in trainer.evaluate()
    state = ckpt.read_state(tmp_path / "up" / "checkpoints" / "solidify")
    assert state["dmc_config"] is None and state["model_config"]["num_query_groups"] == 1
    assert load_model(tmp_path / "up").model.decoder.layers[0].self_attention \
        .num_query_groups_per_partition == 1
