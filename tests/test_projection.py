"""A plan carried over to another capture of the same model (projection.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture import capture
from lightning_antichain.capture.isolation import training_flags_set
from lightning_antichain.in_process.projection import _tensors_used, project_plan


class ExportedNorms(nn.Module):
    """Conv/BatchNorm/dropout blocks; the assert sends it to torch.export, whose train and eval
    graphs differ (batch_norm with or without statistics updates, dropout present or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                                    nn.Dropout(0.2)) for _ in range(4)])
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        assert x.shape[-1] <= 64
        return self.head(self.blocks(x).mean((2, 3)))


def test_an_eval_graph_keeps_every_parameter_on_its_planned_stage():
    torch.manual_seed(0)
    model = ExportedNorms().double()
    x = torch.randn(6, 4, 8, 8, dtype=torch.float64)
    trained = capture(model, x[:2])
    plan = la.partition(la.profile(model, x[:2], op_graph=trained, repeats=1, warmup=0, progress=False), 3)
    with training_flags_set(model, False):
        evaluated = capture(model, x[:2])
    assert {n.name for n in evaluated.nodes} != {n.name for n in trained.nodes}
    projected = project_plan(plan, trained, evaluated)
    planned_stage, projected_stage = plan.stage_of(), projected.stage_of()
    holder = {id(t): planned_stage[n.name] for n in trained.nodes for t in _tensors_used(trained, n)}
    for node in evaluated.nodes:
        for tensor in _tensors_used(evaluated, node):
            if id(tensor) in holder:
                assert projected_stage[node.name] == holder[id(tensor)], node.name
        for source in node.inputs:
            assert projected_stage[source] <= projected_stage[node.name], "a dependency points backward"
    model.eval()
    with la.Pipeline(model, plan, chunks=3, graph=trained) as pipe, torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=0)
        assert pipe.graph is not trained and len(pipe.stages) == 3


def test_a_plan_for_another_model_is_still_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    plan = la.partition(la.profile(model, torch.randn(2, 8), repeats=1, warmup=0, progress=False), 2)
    with pytest.raises(la.PlanMismatchError, match="does not match this model"):
        la.Pipeline(other, plan)
