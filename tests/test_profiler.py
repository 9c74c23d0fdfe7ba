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


class _Vocabulary(nn.Module):
    """An embedding and a head as wide as a vocabulary, around one small layer."""

    def __init__(self, vocab: int = 3000, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


@pytest.mark.parametrize("on_meta", [False, True])
def test_a_weight_over_the_piece_size_is_timed_a_slice_at_a_time_and_counted_whole(monkeypatch, on_meta):
    """The embedding and the head (384 KB each) are replayed on slices of at most 64 KB, and their
    times scaled by the slices the weight holds; what the profile counts (outputs, parameters,
    what backward keeps) is the whole operation's, as without slices."""
    from lightning_antichain.planner import profiler

    torch.manual_seed(0)
    ids = torch.randint(0, 3000, (4, 16))

    def profiled():
        if on_meta:
            with la.init_empty_weights():
                model = _Vocabulary()
        else:
            model = _Vocabulary()
        return la.profile(model, (ids,), "cpu", progress=False, warmup=0, repeats=1, runtime_overhead=False)

    replays = []  # per replay: the shape and bytes of each weight it reads, and its scale (no tensor kept:
    # the just-in-time profile sends each weight back to meta after its last use)

    def one_piece(call):
        found = original(call)
        weights = [(tuple(a.shape), a.numel() * a.element_size()) for a in found[1]
                   if isinstance(a, torch.Tensor) and a.dim() == 2 and a.requires_grad]
        replays.append((weights, found[3]))
        return found

    original = profiler._one_piece
    monkeypatch.setattr(profiler, "_one_piece", one_piece)
    whole = profiled()
    assert all(scale == 1.0 for _, scale in replays)
    replays.clear()
    monkeypatch.setattr(profiler, "PIECE_BYTES", 64 * 1024)
    sliced = profiled()
    scaled = [(weights, scale) for weights, scale in replays if scale > 1]
    assert len(scaled) == 2  # the embedding and the head, not the small layer
    for [(shape, nbytes)], scale in scaled:  # 64 KB of float32 rows of 32, or of columns of 3000
        assert nbytes <= 64 * 1024
        assert shape in ((512, 32), (3000, 5)) and scale == pytest.approx(3000 / 512 if shape[1] == 32 else 32 / 5)
    keys = ("output_bytes", "param_bytes", "saved_bytes")
    assert {v: tuple(whole.nodes[v][k] for k in keys) for v in whole.nodes} == {
        v: tuple(sliced.nodes[v][k] for k in keys) for v in sliced.nodes}
    assert all(sliced.nodes[v]["backward_s"] > 0 for v in sliced.nodes if sliced.nodes[v]["param_bytes"] > 100_000)


def test_the_whole_steps_timing_takes_the_quickest_round_after_the_first_and_two_at_once_against_the_typical():
    """The profile scales its per-op times to the whole step alone: a slow spell of a shared machine
    must not raise it, so the quickest round counts (the first only warms up); two threads at once
    are weighed against the typical round alone. A step that cannot run on two threads at once
    leaves the capacity to calibration."""
    import threading
    import time

    from lightning_antichain.planner.contention import PairedSteps

    alone_s = iter([0.2, 0.06, 0.02, 0.04])  # warm-up, then a spell, the machine, a spell
    lock = threading.Lock()

    def sleeps() -> None:
        if threading.current_thread().name.startswith("antichain-alone"):
            time.sleep(next(alone_s))
        else:
            time.sleep(0.04)

    with PairedSteps([sleeps, sleeps]) as paired:
        for _ in range(4):
            paired.round()
        capacity, quickest = paired.result()
    assert 0.02 <= quickest < 0.035
    assert 1.5 < capacity <= 2.0  # two sleeps at once: the median alone (0.04) over 0.04 together

    def one_at_a_time() -> None:
        if not lock.acquire(blocking=False):
            raise RuntimeError("another thread is in this step")
        try:
            time.sleep(0.01)
        finally:
            lock.release()

    with PairedSteps([one_at_a_time, one_at_a_time]) as paired:
        for _ in range(3):
            paired.round()
        capacity, quickest = paired.result()
    assert capacity is None and quickest >= 0.01
