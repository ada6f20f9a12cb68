"""``optim.trainable: decisions`` (adapter-only): after zero_out and retrofit steps every
parameter except the decision rows of ``linear_qkv`` is bit-identical to the start, and the
decision rows moved (DMC, and DMS distilled from the base). Under bf16 (CUDA; on CPU a replay
of megatron's float16 optimizer step: step the float32 main copy, copy it over the bf16 weight)
the main copies are restored too, and they take ``checkpoint.load_base``'s weights and the zeroed
decision rows."""
import pytest
import torch

from dmc.megatron.attention import decision_rows, dmc_layers
from dmc.training.config import ConfigError, load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides

STEPS = {"schedule.zero_out_steps": 2, "schedule.retrofit_steps": 3,
         "schedule.solidify_steps": 1, "checkpoint.save_interval": 0,
         "logging.heatmap": False, "optim.lr": 1e-2}


@pytest.fixture(scope="module")
def base(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    Trainer(load_config([], tiny_overrides(tiny_data, run_dir, **{
        "schedule.pretrain_steps": 2})), "pretrain").run()
    return run_dir / "checkpoints" / "pretrain"


def _trainer(tiny_data, run_dir, base, **extra):
    overrides = tiny_overrides(tiny_data, run_dir, **{
        **STEPS, "checkpoint.load_base": base, "optim.trainable": "decisions", **extra})
    return Trainer(load_config([], overrides), "retrofit")


def _decision_masks(module) -> dict[str, torch.Tensor]:
    """``{parameter name: bool mask of its decision rows}`` for the DMC layers' linear_qkv, or
    all rows of a DMS adapter's ``decision_proj``."""
    names = {id(p): n for n, p in module.named_parameters()}
    masks = {}
    for layer in dmc_layers(module):
        adapter = getattr(layer, "decision_proj", None)
        weight = layer.linear_qkv.weight if adapter is None else adapter.weight
        mask = torch.zeros(weight.shape[0], dtype=torch.bool)
        mask[decision_rows(layer) if adapter is None else slice(None)] = True
        masks[names[id(weight)]] = mask
    return masks


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("precision, extra", [
    ("fp32", {}),
    ("fp32", {"dmc.method": "dms", "dmc.dms_window": 8, "distill.weight": 0.5}),
    ("fp32", {"dmc.method": "dms", "dmc.dms_window": 8, "dmc.dms_decision": "adapter"}),
    pytest.param("bf16", {}, marks=pytest.mark.gpu),
], ids=["dmc", "dms-distilled", "dms-adapter", "dmc-bf16"])
def test_only_the_decision_rows_change(tiny_data, tmp_path, base, precision, extra):
    """DMS with distillation from the base: Model-Optimizer's recipe (adapter-only + KL).
    DMS adapter decisions: only ``decision_proj`` trains (the vanilla base lacks it: it starts
    at 0), ``linear_qkv`` is frozen whole."""
    trainer = _trainer(tiny_data, tmp_path, base, precision=precision, **extra)
    module = trainer.module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and set(trainable) == set(_decision_masks(module))
    masks = _decision_masks(module)
    start = _snapshot(module)
    mains = {n: p.main_param.clone() for n, p in module.named_parameters()
             if hasattr(p, "main_param")}
    assert (precision == "bf16") == bool(mains)
    results = trainer.run()
    assert [r.phase for r in results] == ["zero_out"] * 2 + ["retrofit"] * 3 + ["solidify"]
    moved = 0
    for name, param in module.named_parameters():
        now, then = param.detach(), start[name]
        frozen = ~masks[name] if name in masks else torch.ones(now.shape[0], dtype=torch.bool)
        assert torch.equal(now[frozen], then[frozen]), name
        if name in mains:
            assert torch.equal(param.main_param[frozen], mains[name][frozen]), name
        if name in masks:
            moved += int(not torch.equal(now[~frozen], then[~frozen]))
    assert moved == len(masks) == 2
    assert max(r.measured_cr for r in results) > 1.0
    if trainer.stage is not None:
        # KL >= 0 up to float32 rounding: while the student still equals the teacher (zero-out),
        # cross-entropy minus the two log-partition terms can land a hair below 0
        assert all(r.extra["kl_loss"] >= -1e-6 for r in results)
        assert results[-1].extra["kl_loss"] > 0


def test_around_step_restores_bf16_weights_and_main_copies(parallel_1x1):
    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.runtime import DMCConfig, DMCRuntime
    from dmc.training.adapter import DecisionRowsOnly

    config = llama_transformer_config(2, 64, 4, 96, num_query_groups=2,
                                      params_dtype=torch.bfloat16)
    model = build_gpt_model(config, 96, 32, dmc=DMCRuntime(DMCConfig()))
    adapter = DecisionRowsOnly(model)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 2 and len(adapter.targets) == 2
    gen = torch.Generator().manual_seed(0)
    for param in params:
        param.main_param = param.detach().float().clone()
        param.main_grad = torch.randn(param.shape, generator=gen)
    start = [(p.detach().clone(), p.main_param.clone()) for p in params]
    for _ in range(2):
        with adapter.around_step():  # AdamW's first step: -lr * (sign(grad) + wd * w)
            for param in params:
                main = param.main_param
                main -= 1e-2 * (param.main_grad.sign() + 0.1 * main)
                with torch.no_grad():
                    param.copy_(main)
    for param, (weight, main), (_, frozen) in zip(params, start, adapter.targets):
        assert not param.main_grad[frozen].any() and param.main_grad[~frozen].all()
        assert torch.equal(param[frozen], weight[frozen])
        assert torch.equal(param.main_param[frozen], main[frozen])
        assert (param[~frozen].float() - weight[~frozen].float()).abs().min() > 1e-3


@pytest.mark.gpu
def test_bf16_main_copies_hold_the_base_and_the_zeroed_rows(tiny_data, tmp_path, base):
    trainer = _trainer(tiny_data, tmp_path, base, precision="bf16", **{
        "optim.trainable": "all", "optim.lr": 1e-7})
    for name, param in trainer.module.named_parameters():
        assert torch.equal(param.main_param, param.detach().float()), name
    trainer.run(stop_after=3)  # zero_out, zero_out, then the rows are zeroed and trained once
    for layer in dmc_layers(trainer.module):
        rows = decision_rows(layer)
        weight = layer.linear_qkv.weight
        assert weight[rows].abs().max() < 1e-5  # one Adam step of lr 1e-7 from zero
        assert weight.main_param[rows].abs().max() < 1e-5


def test_decisions_need_dmc_layers(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="optim.trainable: decisions .* dmc.enabled is false"):
        load_config([], tiny_overrides(tiny_data, tmp_path, **{
            "optim.trainable": "decisions", "dmc.enabled": False}))
    with pytest.raises(ConfigError, match="optim.trainable: 'rows' is not one of all, decisions"):
        load_config([], tiny_overrides(tiny_data, tmp_path, **{"optim.trainable": "rows"}))
