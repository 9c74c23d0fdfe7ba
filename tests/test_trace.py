"""Tracing real models, the clear error for untraceable ones, and the children fallback."""

import pytest
import torch
import torchvision
from torch import nn

import lightning_antichain as la


class DataDependent(nn.Module):
    """Python control flow on a tensor value: fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

    def forward(self, x):
        x = self.stem(x)
        if x.mean() > 0:
            x = self.body(x)
        return self.head(x)


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(4, 4)
        self.right = nn.Linear(4, 4)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.cat([self.left(x), self.right(x)], dim=1))


def test_traces_torchvision_resnet_at_op_level():
    graph = la.trace(torchvision.models.resnet18(num_classes=10))
    assert graph.granularity == "ops"
    kinds = {n.kind for n in graph.nodes}
    assert {"placeholder", "call_module", "call_function"} <= kinds
    names = [n.name for n in graph.nodes]
    assert names.index("conv1") < names.index("fc")
    assert graph.outputs == ("fc",)
    assert graph["layer1_0_conv1"].top_level == "layer1"


def test_untraceable_model_gets_a_clear_error_without_fallback():
    with pytest.raises(la.UntraceableModelError) as info:
        la.trace(DataDependent(), torch.randn(2, 3, 8, 8), fallback=None)
    message = str(info.value)
    assert "DataDependent" in message
    assert "control flow" in message
    assert "test_trace.py" in message  # points at the offending line
    assert "leaf_modules=" in message and "module=" in message  # what to do, in the strategy's own terms


def test_untraceable_model_falls_back_to_children():
    graph = la.trace(DataDependent(), torch.randn(2, 3, 8, 8))
    assert graph.granularity == "children"
    assert "fell back" in graph.note
    assert [n.name for n in graph.nodes] == ["input_0", "stem", "body", "head"]
    assert graph["head"].inputs == ("body",)


def test_children_fallback_finds_branches():
    graph = la.trace(TwoBranches(), torch.randn(3, 4), granularity="children")
    assert graph["left"].inputs == ("input_0",)
    assert graph["right"].inputs == ("input_0",)
    # torch.cat runs between children, so 'out' depends on the last child called
    assert graph["out"].inputs == ("right",)
    assert graph.outputs == ("out",)


def test_planner_accepts_the_fallback_graph():
    cost = la.profile(DataDependent(), torch.randn(4, 3, 8, 8), repeats=1, warmup=0, progress=False)
    assert cost.graph["granularity"] == "children"
    plan = la.partition(cost, 2)
    assert sorted(plan.stage_of()) == ["body", "head", "input_0", "stem"]


def test_profile_without_fallback_raises():
    with pytest.raises(la.UntraceableModelError):
        la.profile(DataDependent(), torch.randn(4, 3, 8, 8), fallback=None, progress=False)


def test_leaf_modules_keep_a_block_whole():
    model = torchvision.models.resnet18(num_classes=10)
    whole = la.trace(model, leaf_modules=[torchvision.models.resnet.BasicBlock])
    assert "layer1_0" in [n.name for n in whole.nodes]
    assert len(whole) < len(la.trace(model))


def test_traces_a_lightning_module_through_its_forward():
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            self.example_input_array = torch.randn(2, 8)

        def forward(self, x):
            return self.net(x).softmax(-1)

    model = Classifier()
    graph = la.trace(model)
    assert [n.name for n in graph.nodes] == ["x", "net_0", "net_1", "net_2", "softmax"]
    cost = la.profile(model, model.example_input_array, progress=False)
    assert la.partition(cost, 2).num_stages == 2
