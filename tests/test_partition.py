"""The dynamic program against exhaustive search, and the properties every plan must have."""

import math
from functools import cache

import networkx as nx
import pytest
import torch
from conftest import random_cost_graph
from test_antichain import brute_force_down_sets

import lightning_antichain as la
from lightning_antichain.planner.partition import METHODS


def brute_force_bottleneck(graph, speeds, bandwidth=math.inf, memory=None, chunks=1, opt=2.0, accumulate=0.0,
                           window=1):
    """Best bottleneck over every chain of down-sets and every order of the devices, by search; the
    first stage's device also holds the joined output and its gradient (2 x chunks x the outputs);
    each backward after a stage's first adds ``accumulate`` a trainable parameter byte, and the
    first too in each of a ``window`` of accumulated batches but one."""
    pinned = frozenset(v for v in graph.nodes if graph.nodes[v].get("pinned"))
    free = graph.subgraph(set(graph.nodes) - pinned)
    down_sets = [d | pinned for d in brute_force_down_sets(free)]
    full = frozenset(graph.nodes)
    outputs = {v for v in graph.nodes if graph.out_degree(v) == 0}
    attr = lambda v, k: graph.nodes[v].get(k, 0)  # noqa: E731

    def cut_bytes(inside):
        return sum(
            attr(v, "output_bytes") for v in inside if v in outputs or any(c not in inside for c in graph.successors(v))
        )

    def stage_time(before, after, device):
        nodes = after - before - pinned
        compute = sum(attr(v, "forward_s") + attr(v, "backward_s") for v in nodes) / speeds[device]
        transfer = 2 * (cut_bytes(before) + cut_bytes(after)) / bandwidth
        if memory is not None:
            activations = sum(attr(v, "output_bytes") for v in nodes) + cut_bytes(before)
            params = sum(attr(v, "param_bytes") for v in nodes)
            need = params * (2 + opt) + sum(attr(v, "buffer_bytes") for v in nodes) + activations * chunks
            if before == pinned:
                need += 2 * chunks * sum(attr(v, "output_bytes") for v in outputs)
            if need > memory[device]:
                return math.inf
        trainable = sum(attr(v, "param_bytes") - attr(v, "frozen_bytes") for v in nodes)
        adding = (chunks - 1) + (window - 1) / window  # backwards adding per step, on average over the window
        return compute + transfer + accumulate * trainable * adding / chunks

    @cache
    def best(before, devices_left):
        if not devices_left:
            return 0.0 if before == full else math.inf
        result = math.inf
        for after in down_sets:
            if before < after:
                for device in set(devices_left):
                    rest = list(devices_left)
                    rest.remove(device)
                    t = stage_time(before, after, device)
                    if t < result:
                        result = min(result, max(t, best(after, tuple(rest))))
        return result

    return best(pinned, tuple(range(len(speeds))))


def assert_valid(plan, graph):
    stage_of = plan.stage_of()
    assert sorted(stage_of) == sorted(map(str, graph.nodes)), "every node in exactly one stage"
    assert sum(len(s.nodes) for s in plan.stages) == graph.number_of_nodes()
    for u, v in graph.edges:
        assert stage_of[str(u)] <= stage_of[str(v)], f"edge {u}->{v} runs backwards"
    assert all(any(not graph.nodes[v].get("pinned") for v in s.nodes) for s in plan.stages)


@pytest.mark.parametrize("seed", range(60))
def test_dp_matches_exhaustive_search(seed):
    graph = random_cost_graph(seed, max_nodes=12 if seed % 3 else 9, with_input=seed % 2 == 0)
    stages = 2 + seed % 3
    free = [v for v in graph.nodes if not graph.nodes[v].get("pinned")]
    if len(free) < stages:
        stages = len(free)
    bandwidth = [math.inf, 1e4, 1e5][seed % 3]
    plan = la.partition(graph, stages, bandwidth_gbps=None if math.isinf(bandwidth) else bandwidth / 1e9)
    expected = brute_force_bottleneck(graph, [1.0] * stages, bandwidth)
    assert plan.bottleneck_s == pytest.approx(expected, rel=1e-9)
    assert_valid(plan, graph)


@pytest.mark.parametrize("seed", range(20))
def test_dp_weighs_each_stage_s_adding_into_its_gradients(seed):
    """A stage's backwards after its first add into its gradients, a cost of its trainable
    parameters rather than of its compute: the program cuts on it as the search does."""
    graph = random_cost_graph(seed, max_nodes=9, with_input=True)
    for v in graph.nodes:
        graph.nodes[v]["frozen_bytes"] = graph.nodes[v].get("param_bytes", 0) // 2 if seed % 2 else 0
    graph.graph["accumulate_s_per_byte"] = 2e-4  # comparable to the operations' seconds
    stages = min(2 + seed % 3, sum(1 for v in graph.nodes if not graph.nodes[v].get("pinned")))
    plan = la.partition(graph, stages, chunks=4)
    assert plan.accumulate_s_per_byte == 2e-4
    dp = max(s.time_s + 0.75 * plan.prediction.accumulation_s(s) for s in plan.stages)
    assert dp == pytest.approx(brute_force_bottleneck(graph, [1.0] * stages, chunks=4, accumulate=2e-4), rel=1e-9)
    assert_valid(plan, graph)
    window = 2 + seed % 3  # Lightning accumulating over batches: a batch's first backward adds too, but the first's
    plan = la.partition(graph, stages, chunks=4, accumulate_grad_batches=window)
    assert plan.accumulate_grad_batches == window
    dp = max(s.time_s + (4 - 1 / window) / 4 * plan.prediction.accumulation_s(s) for s in plan.stages)
    assert dp == pytest.approx(brute_force_bottleneck(graph, [1.0] * stages, chunks=4, accumulate=2e-4,
                                                      window=window), rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_dp_matches_search_with_unequal_devices_and_memory(seed):
    graph = random_cost_graph(100 + seed, max_nodes=9, with_input=True)
    free = [v for v in graph.nodes if not graph.nodes[v].get("pinned")]
    stages = min(3, len(free))
    speeds = [1.0, 2.5, 1.0][:stages]
    total = sum(graph.nodes[v]["param_bytes"] * 4 + graph.nodes[v]["output_bytes"] * 2 for v in free)
    memory = [total * 0.6, total * 0.35, total * 0.6][:stages]
    expected = brute_force_bottleneck(graph, speeds, 1e5, memory, chunks=2)
    kwargs = dict(chunks=2, speeds=speeds, memory_gb=[m / 1e9 for m in memory], bandwidth_gbps=1e-4)
    if math.isinf(expected):
        with pytest.raises(la.InfeasiblePlanError, match="stage|operation"):
            la.partition(graph, stages, **kwargs)
        return
    plan = la.partition(graph, stages, **kwargs)
    assert plan.bottleneck_s == pytest.approx(expected, rel=1e-9)
    assert_valid(plan, graph)
    for stage in plan.stages:
        assert stage.memory_bytes <= stage.memory_limit_bytes


@pytest.mark.parametrize("seed", range(30))
def test_baselines_are_valid_and_never_better(seed):
    graph = random_cost_graph(200 + seed, with_input=True)
    free = [v for v in graph.nodes if not graph.nodes[v].get("pinned")]
    stages = min(len(free), 2 + seed % 4)
    ours = la.partition(graph, stages, bandwidth_gbps=1e-4)
    for method in METHODS[1:]:
        baseline = la.partition(graph, stages, method=method, bandwidth_gbps=1e-4)
        assert_valid(baseline, graph)
        assert ours.bottleneck_s <= baseline.bottleneck_s * (1 + 1e-12)


def test_uniform_baseline_splits_counts_evenly():
    graph = nx.DiGraph([(i, i + 1) for i in range(9)])
    plan = la.partition(graph, 3, method="uniform")
    assert plan.balance == [4, 3, 3]


def test_optimal_split_prefers_small_cuts_among_equal_bottlenecks():
    # a -> b -> c with a huge tensor a->b: cutting after b ships only b's small output
    graph = nx.DiGraph([("a", "b"), ("b", "c")])
    for v, t, nbytes in [("a", 1.0, 10**9), ("b", 0.1, 10), ("c", 2.0, 10)]:
        graph.nodes[v].update(forward_s=t, output_bytes=nbytes)
    plan = la.partition(graph, 2, bandwidth_gbps=1.0)
    assert [s.nodes for s in plan.stages] == [["a", "b"], ["c"]]


def test_lower_bound_and_prediction():
    graph = nx.DiGraph([(i, i + 1) for i in range(7)])
    nx.set_node_attributes(graph, 1.0, "forward_s")
    nx.set_node_attributes(graph, 2.0, "backward_s")
    plan = la.partition(graph, 4, chunks=8)
    assert plan.lower_bound_s == pytest.approx(6.0)
    assert plan.bottleneck_s == pytest.approx(6.0)
    # GPipe: (M + K - 1) ticks of forward and of backward
    assert plan.predicted_step_s == pytest.approx((8 + 4 - 1) * 6.0)


def test_too_little_memory_names_the_stage():
    graph = nx.DiGraph([(i, i + 1) for i in range(5)])
    for v in graph.nodes:
        graph.nodes[v].update(forward_s=1.0, param_bytes=100e6, output_bytes=1e6)
    with pytest.raises(la.InfeasiblePlanError, match=r"on stage \d, [\d.]+ GB over its limit"):
        la.partition(graph, 2, memory_gb=0.5)  # each op needs 0.4 GB with Adam: 3 ops fit nowhere
    with pytest.raises(la.InfeasiblePlanError, match=r"operation 0 alone needs 0\.4\d* GB"):
        la.partition(graph, 2, memory_gb=0.3)
    fits = la.partition(graph, 3, memory_gb=0.85)
    assert all(s.memory_bytes <= 0.85e9 for s in fits.stages)


def test_more_stages_than_operations_is_a_clear_error():
    graph = nx.DiGraph([("a", "b")])
    with pytest.raises(la.InfeasiblePlanError, match="cannot cut 2 operations into 3 stages"):
        la.partition(graph, 3)


def test_unequal_devices_get_matching_loads():
    graph = nx.DiGraph([(i, i + 1) for i in range(11)])
    nx.set_node_attributes(graph, 1.0, "forward_s")
    plan = la.partition(graph, 2, devices=["slow", "fast"], speeds=[1.0, 3.0])
    loads = {s.device: len(s.nodes) for s in plan.stages}
    assert loads == {"slow": 3, "fast": 9}
    assert plan.bottleneck_s == pytest.approx(3.0)


class SharedTwice(torch.nn.Module):
    """One Linear applied at two places: both calls read the same parameters."""

    def __init__(self):
        super().__init__()
        self.a, self.shared, self.b, self.c = (torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        return self.c(self.shared(torch.tanh(self.b(self.shared(torch.tanh(self.a(x)))))))


def test_tied_parameters_are_colocated_only_when_asked():
    """Both runtimes give each device that uses a tied parameter its own copy, so by default a tie
    may be cut apart, across devices too; ``colocate_tied=True`` keeps its uses in one stage."""
    from models import TiedEmbedding

    cost = la.profile(SharedTwice(), torch.randn(4, 32), repeats=1, warmup=0, progress=False)
    assert la.partition.__globals__["tied_groups"](cost) == [{"shared", "shared_1"}]
    plan = la.partition(cost, 3, devices=["cuda:0", "cuda:1", "cuda:2"], colocate_tied=True)
    stage_of = plan.stage_of()
    assert stage_of["shared"] == stage_of["shared_1"]
    assert plan.num_stages == 3
    tied = la.profile(TiedEmbedding(), torch.randint(0, 40, (4, 7)), repeats=1, warmup=0, progress=False)
    with pytest.raises(la.InfeasiblePlanError, match="colocate_tied=True, tied parameters stay.*embed.*head"):
        la.partition(tied, 2, devices=["cuda:0", "cuda:1"], colocate_tied=True)
    stage_of = la.partition(tied, 2, devices=["cuda:0", "cuda:1"]).stage_of()
    assert (stage_of["embed"], stage_of["head"]) == (0, 1)




@pytest.mark.parametrize("stages", [3, 8])
def test_a_long_chain_is_cut_coarse_to_fine_within_a_percent_of_the_exact_program(stages):
    """1,400 prefixes: the program runs first on one prefix per window, then with each cut between
    its neighbours' places; its slowest stage is within 1% of the program over every prefix."""
    from test_antichain import _skip_chain

    from lightning_antichain.planner.antichain import build_state_space
    from lightning_antichain.planner.cost_model import CostModel, device_specs
    from lightning_antichain.planner.dp import solve_bottleneck, stage_nodes_of_chain

    graph = _skip_chain(1400, seed=stages)
    plan = la.partition(graph, stages, max_states=100)
    assert any("then each cut at any prefix between its neighbours' first places" in note for note in plan.compression)
    space = build_state_space(graph, max_states=100)
    model = CostModel(1, math.inf, 2.0, "never")
    chain, _ = solve_bottleneck(space, device_specs(stages, None, None, None), model)
    exact = max(sum(graph.nodes[v]["forward_s"] + graph.nodes[v]["backward_s"] for v in nodes)
                for nodes in stage_nodes_of_chain(space, chain))
    assert exact * (1 - 1e-9) <= plan.bottleneck_s <= 1.01 * exact


def test_a_long_chain_whose_only_fitting_split_falls_between_the_coarse_states_is_still_found():
    """Equal operations and a memory limit that only a split into equal quarters meets: the coarse
    program's states miss it, so a split that fits is found among all the prefixes and the program
    runs again with its states."""
    graph = nx.DiGraph()
    for v in range(1400):
        graph.add_node(f"n{v}", forward_s=1.0, backward_s=2.0, output_bytes=1000, param_bytes=10_000, order=v)
        if v:
            graph.add_edge(f"n{v - 1}", f"n{v}")
    quarters = la.plan_from_balance(graph, [350] * 4)
    limit = max(stage.memory_bytes for stage in quarters.stages)
    plan = la.partition(graph, 4, memory_gb=limit / 1e9, max_states=100)
    assert [len(stage.nodes) for stage in plan.stages] == [350] * 4
    with pytest.raises(la.InfeasiblePlanError, match="no split into 4 stages fits"):
        la.partition(graph, 4, memory_gb=0.999 * limit / 1e9, max_states=100)
