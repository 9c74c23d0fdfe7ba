"""A plan names the modules each stage covers, in its table, its JSON and its picture."""

from __future__ import annotations

import pytest
import torch
import torchvision

import lightning_antichain as la

transformers = pytest.importorskip("transformers")


def llama_plan() -> tuple[torch.nn.Module, la.Plan]:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    plan = la.plan(model, torch.randint(0, 64, (8, 12)), ["cpu"] * 3, chunks=4, use_profile_cache=False,
                   calibrate=False, progress=False)
    return model, plan


@pytest.mark.parametrize("which", ["export", pytest.param("fx", marks=pytest.mark.slow)])
def test_each_stage_names_the_modules_of_its_first_and_last_operations(which, tmp_path):
    if which == "export":
        model, plan = llama_plan()
        assert plan.frontend == "export"
    else:
        model = torchvision.models.resnet18(num_classes=10)
        plan = la.plan(model, torch.randn(8, 3, 32, 32), ["cpu"] * 2, chunks=4, use_profile_cache=False,
                       calibrate=False, progress=False)
        assert plan.frontend == "fx"
    names = dict(model.named_modules())
    for stage in plan.stages:
        assert len(stage.modules) == 2 and all(m in names for m in stage.modules), stage.modules
    assert plan.stages[0].modules[0] in ("model.embed_tokens", "conv1")
    assert plan.stages[-1].modules[-1] in ("lm_head", "fc")
    table = plan.table()
    assert "first .. last module" in table
    assert f"{plan.stages[1].modules[0]} .. {plan.stages[1].modules[1]}" in table
    plan.save(tmp_path / "plan.json")
    assert [s.modules for s in la.Plan.load(tmp_path / "plan.json").stages] == [s.modules for s in plan.stages]
    pytest.importorskip("matplotlib")
    from lightning_antichain.planner.plot import plot_plan

    plot_plan(plan, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0
