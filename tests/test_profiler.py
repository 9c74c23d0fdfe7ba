"""Profiling real modules: what is measured, and the JSON round trips of cost graph and plan."""

import json
import math

import pytest
import torch
import torchvision
from torch import nn

import lightning_antichain as la


class DictModel(nn.Module):
    """Keyword inputs, a parameter used through get_attr, and a tuple output."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 3)

    def forward(self, image, extra):
        h = torch.relu(self.embed(image)) * self.scale + extra
        return self.head(h), h


@pytest.fixture(scope="module")
def resnet_cost():
    torch.set_num_threads(1)
    model = torchvision.models.resnet18(num_classes=10)
    return model, la.profile(model, torch.randn(4, 3, 32, 32), repeats=2, warmup=1, progress=False)


def test_costs_are_measured_per_node(resnet_cost):
    model, cost = resnet_cost
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(cost.nodes[v]["param_bytes"] for v in cost.nodes) == params
    assert sum(cost.nodes[v]["buffer_bytes"] for v in cost.nodes) == buffers
    assert cost.nodes["fc"]["output_bytes"] == 4 * 10 * 4
    assert cost.nodes["conv1"]["output_bytes"] == 4 * 64 * 16 * 16 * 4
    assert cost.nodes["x"]["pinned"] and cost.nodes["x"]["forward_s"] == 0
    assert cost.nodes["conv1"]["forward_s"] > 0 and cost.nodes["conv1"]["backward_s"] > 0
    # the stem convolution needs no input gradient, but its weight gradient still costs time
    assert cost.nodes["layer4_0_conv1"]["backward_s"] > 0
    assert cost.graph["micro_batch_size"] == 4
    assert cost.graph["granularity"] == "ops"
    assert cost.graph["outputs"] == ["fc"]
    assert cost.graph["profile_s"] > 0


def test_profiling_leaves_the_module_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    la.profile(model, torch.randn(3, 4), progress=False)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_keyword_inputs_tuple_outputs_and_attributes():
    cost = la.profile(DictModel(), {"image": torch.randn(5, 6), "extra": torch.randn(5, 16)}, progress=False)
    assert cost.nodes["image"]["pinned"] and cost.nodes["extra"]["pinned"]
    # a parameter fetch is not an operation of its own: its bytes belong to the op that reads it
    assert "scale" not in cost.nodes
    assert cost.nodes["mul"]["param_bytes"] == 16 * 4 and cost.nodes["mul"]["params"] == ["scale"]
    assert set(cost.graph["outputs"]) == {"head", "add"}
    plan = la.partition(cost, 2)
    assert plan.stage_of()["image"] == 0


def test_cost_graph_json_round_trip(resnet_cost, tmp_path):
    _, cost = resnet_cost
    path = tmp_path / "cost.json"
    la.save_cost_graph(cost, path)
    loaded = la.load_cost_graph(path)
    assert dict(loaded.nodes(data=True)) == dict(cost.nodes(data=True))
    assert set(loaded.edges) == set(cost.edges)
    assert all(loaded.edges[e]["bytes"] == cost.edges[e]["bytes"] for e in cost.edges)
    assert loaded.graph == cost.graph
    a, b = la.partition(cost, 3, chunks=4), la.partition(loaded, 3, chunks=4)
    assert [s.nodes for s in a.stages] == [s.nodes for s in b.stages]


def test_plan_json_round_trip_and_table(resnet_cost, tmp_path):
    _, cost = resnet_cost
    plan = la.partition(cost, 4, chunks=4, bandwidth_gbps=2.0, memory_gb=1.0)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = la.Plan.load(path)
    assert loaded == plan
    data = json.loads(path.read_text())
    assert {"stages", "bottleneck_s", "lower_bound_s", "solve_s", "profile_s", "num_states"} <= set(data)
    assert {"nodes", "compute_s", "transfer_s", "memory_bytes"} <= set(data["stages"][0])
    table = plan.table()
    assert "bottleneck" in table and table.count("\n") >= 6
    assert math.isclose(plan.bottleneck_s, max(s.time_s for s in plan.stages))


def test_cost_graph_rejects_other_json():
    with pytest.raises(la.CostGraphError):
        la.planner.cost_graph.cost_graph_from_dict({"format": "something else"})


def test_the_cost_graph_keeps_the_given_model_name():
    cost = la.profile(DictModel(), {"image": torch.randn(2, 6), "extra": torch.randn(2, 16)}, progress=False, name="m")
    assert cost.graph["model"] == "m"
    assert la.partition(cost, 2).model == "m"
