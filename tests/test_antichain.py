"""Down-set states: counts against hand counts, order, cuts against a direct computation."""

import itertools

import networkx as nx
import pytest
import torch
import torchvision
from conftest import random_cost_graph

import lightning_antichain as la
from lightning_antichain.planner.antichain import build_state_space, compress_branch_chains, enumerate_down_sets


def graph_of(edges, nodes=()):
    graph = nx.DiGraph(edges)
    graph.add_nodes_from(nodes)
    for i, v in enumerate(nx.lexicographical_topological_sort(graph)):
        graph.nodes[v].update(order=i, output_bytes=10 * (i + 1), forward_s=1.0)
    return graph


def brute_force_down_sets(graph):
    nodes = list(graph.nodes)
    result = []
    for r in range(len(nodes) + 1):
        for subset in itertools.combinations(nodes, r):
            inside = set(subset)
            if all(p in inside for v in inside for p in graph.predecessors(v)):
                result.append(frozenset(inside))
    return result


def test_chain_has_one_state_per_prefix():
    graph = graph_of([("a", "b"), ("b", "c"), ("c", "d")])
    assert len(build_state_space(graph)) == 5  # empty, a, ab, abc, abcd


def test_diamond_hand_count():
    graph = graph_of([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    space = build_state_space(graph)
    assert {frozenset(space.down_set(s)) for s in range(len(space))} == {
        frozenset(),
        frozenset("a"),
        frozenset("ab"),
        frozenset("ac"),
        frozenset("abc"),
        frozenset("abcd"),
    }
    assert enumerate_down_sets([[], [0], [0], [1, 2]]) == [0, 1, 3, 5, 7, 15]


def test_resnet_blocks_hand_counts():
    identity = graph_of([("in", "c1"), ("c1", "c2"), ("c2", "add"), ("in", "add"), ("add", "out")])
    assert len(build_state_space(identity)) == 6  # a chain once 'in' is taken
    projection = graph_of([("in", "c1"), ("c1", "c2"), ("c2", "add"), ("in", "s1"), ("s1", "add"), ("add", "out")])
    # empty, in, then (c1 chain: 0..2 done) x (s1: 0..1 done) = 6, then add, out
    assert len(build_state_space(projection)) == 9


def test_traced_torchvision_basic_block_hand_count():
    block = torchvision.models.resnet.BasicBlock(
        4,
        8,
        stride=2,
        downsample=torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1, stride=2), torch.nn.BatchNorm2d(8)),
    )
    graph = la.profile(block, torch.randn(2, 4, 8, 8), repeats=1, warmup=0, progress=False)
    # x is pinned; main branch conv1,bn1,relu,conv2,bn2 (0..5 done) x shortcut conv,bn (0..2 done),
    # then add and the final relu.
    assert len(build_state_space(graph)) == 6 * 3 + 2


@pytest.mark.parametrize("seed", range(40))
def test_states_are_exactly_the_down_sets_in_a_topological_order(seed):
    graph = random_cost_graph(seed, max_nodes=10, with_input=seed % 2 == 0)
    space = build_state_space(graph)
    pinned = {v for v in graph.nodes if graph.nodes[v].get("pinned")}
    free = graph.subgraph(set(graph.nodes) - pinned)
    expected = {d | pinned for d in brute_force_down_sets(free)}
    found = [frozenset(space.down_set(s)) for s in range(len(space))]
    assert len(found) == len(set(found)) == len(expected)
    assert set(found) == expected
    contains = space.contains()
    for i, j in itertools.combinations(range(len(space)), 2):
        assert not found[j] < found[i], "a superset comes before its subset"
        assert contains[j, i] == (found[i] < found[j])


@pytest.mark.parametrize("seed", range(20))
def test_cut_bytes_match_direct_computation(seed):
    graph = random_cost_graph(seed, with_input=True)
    outputs = {v for v in graph.nodes if graph.out_degree(v) == 0}
    space = build_state_space(graph)
    for s in range(len(space)):
        inside = set(space.down_set(s))
        cut = {v for v in inside if v in outputs or any(c not in inside for c in graph.successors(v))}
        assert set(space.cut(s)) == cut
        assert space.cut_bytes[s] == sum(graph.nodes[v]["output_bytes"] for v in cut)
        assert space.compute[s] == pytest.approx(
            sum(graph.nodes[v].get("forward_s", 0) + graph.nodes[v].get("backward_s", 0) for v in inside)
        )


def test_antichain_names_its_down_set():
    graph = graph_of([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    space = build_state_space(graph)
    by_set = {frozenset(space.down_set(s)): s for s in range(len(space))}
    assert sorted(space.antichain(by_set[frozenset("abc")])) == ["b", "c"]
    assert space.antichain(by_set[frozenset("abcd")]) == ["d"]


def test_wide_graph_is_compressed_and_says_so():
    # 4 blocks of 6 parallel branches of 4 ops: 4 * 5**6 down-sets uncompressed
    edges, prev = [], "src"
    for b in range(4):
        join = f"join{b}"
        for k in range(6):
            chain = [prev] + [f"b{b}_{k}_{i}" for i in range(4)] + [join]
            edges += list(zip(chain, chain[1:], strict=False))
        prev = join
    graph = graph_of(edges)
    space = build_state_space(graph, max_states=2000)
    assert len(space) <= 2000 + graph.number_of_nodes() + 1
    assert any("merged the chains" in c for c in space.compression)
    free_nodes = set(graph.nodes)
    assert set(space.down_set(len(space) - 1)) == free_nodes
    # the prefixes of the execution order are always states
    order = sorted(graph.nodes, key=lambda v: graph.nodes[v]["order"])
    states = {frozenset(space.down_set(s)) for s in range(len(space))}
    assert all(frozenset(order[:i]) in states for i in range(len(order) + 1))


def test_hopeless_width_falls_back_to_prefixes():
    graph = graph_of([], nodes=[f"v{i}" for i in range(30)])  # 2**30 down-sets, no chains to merge
    space = build_state_space(graph, max_states=500)
    assert len(space) == 31
    assert any("prefixes" in c for c in space.compression)


def test_branch_chain_compression_groups():
    graph = graph_of([("a", "b1"), ("b1", "b2"), ("a", "c1"), ("b2", "d"), ("c1", "d"), ("d", "e")])
    order = {v: graph.nodes[v]["order"] for v in graph.nodes}
    groups = compress_branch_chains(graph, order)
    assert sorted(map(sorted, groups)) == [["a"], ["b1", "b2"], ["c1"], ["d"], ["e"]]


def test_enumeration_is_iterative_on_long_chains():
    n = 5000  # far past Python's recursion limit
    assert len(enumerate_down_sets([[]] + [[i] for i in range(n - 1)])) == n + 1


def _skip_chain(n: int, seed: int) -> nx.DiGraph:
    """A chain with skip connections over two nodes (a residual stream), random costs."""
    rng = torch.Generator().manual_seed(seed)
    graph = nx.DiGraph()
    for v in range(n):
        forward, output, params = torch.rand(3, generator=rng).tolist()
        graph.add_node(f"n{v}", forward_s=0.1 + forward, backward_s=0.2 + 2 * forward,
                       output_bytes=int(1000 + 9000 * output), param_bytes=int(50_000 * params), order=v)
        graph.add_edges_from((f"n{u}", f"n{v}") for u in (v - 1, v - 3) if u >= 0)
    return graph


def test_prefix_states_sum_each_prefix_and_take_the_times_of_the_graph_they_are_built_for():
    """Past its limit the space keeps the prefixes only; their sums run over the nodes, and a graph of
    the same shape with other times (a layout search's next micro-batch size) gets its own sums."""
    graph = _skip_chain(60, seed=0)
    space = build_state_space(graph, max_states=50)
    assert space.prefixes_only and len(space) == 61
    nodes = space.nodes
    for state in (0, 1, 17, 60):
        inside = space.down_set(state)
        assert space.compute[state] == pytest.approx(sum(graph.nodes[v]["forward_s"] + graph.nodes[v]["backward_s"]
                                                         for v in inside))
        assert space.cut_bytes[state] == sum(graph.nodes[v]["output_bytes"] for v in space.cut(state))
        assert inside == nodes[:state]
    slower = graph.copy()
    for v in slower.nodes:
        slower.nodes[v]["forward_s"] *= 3
    again = build_state_space(slower, max_states=50)
    assert again.membership is space.membership  # the shape's states were found once
    assert again.forward[-1] == pytest.approx(3 * space.forward[-1])
    contains = space.contains()
    assert contains[5, 4] and not contains[4, 5] and not contains[4, 4]
