"""Antichain states of a DAG: the down-sets a pipeline can be cut at.

A pipeline of K stages over a DAG is a chain of down-sets ``D0 ⊂ D1 ⊂ ... ⊂ DK = V`` (a down-set
holds every ancestor of each of its members); stage k runs ``Dk \\ Dk-1``, and every edge then goes
from an earlier stage to a later one or stays inside a stage. Each down-set is named by its
antichain of maximal nodes, which is why the paper calls the state graph the *antichain DAG*.

For every state this module records what the dynamic program needs: its cumulative compute,
parameter and activation bytes, and its precise *cut*: the nodes inside whose outputs are still
needed outside (a consumer outside, or a model output). That is the set PipeDream's "augmented
antichain" approximates, without its over-inclusion.

The number of down-sets multiplies across parallel branches (Inception-v3 at op level has about
221k). :func:`build_state_space` enumerates them up to ``max_states``; beyond that it first merges
the chains inside parallel branches into single nodes, and as a last resort keeps only the
prefixes of the execution order. Every step taken is listed in :attr:`StateSpace.compression`. The
prefixes of the execution order are always added, so every cut a contiguous splitter could make is
among the states.

The states depend on the graph's shape alone, so they are found once per shape
(:func:`_shape_of`): a layout search cuts one model's cost graph for every micro-batch size and
device count, and each of those graphs has the same shape and other times and sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
import numpy as np

from .cost_graph import node_compute, normalize_cost_graph, ordered_nodes

DEFAULT_MAX_STATES = 3000
MAX_CHAIN_PIECES = 4


class TooManyStatesError(RuntimeError):
    """Raised by :func:`enumerate_down_sets` when the count passes its limit."""


@dataclass
class StateSpace:
    """The ordered down-set states of a cost graph and their cumulative quantities.

    State 0 is the empty down-set (only pinned inputs), the last state is the whole graph, and
    states are sorted by size, so ``i < j`` whenever ``D_i ⊂ D_j``. Arrays are indexed by state.
    """

    graph: nx.DiGraph
    nodes: list[Any]
    masks: list[int]
    compute: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    param_bytes: np.ndarray
    frozen_bytes: np.ndarray
    buffer_bytes: np.ndarray
    activation_bytes: np.ndarray
    cut_bytes: np.ndarray
    membership: np.ndarray = field(repr=False)
    cut_membership: np.ndarray = field(repr=False)
    forbidden: np.ndarray = field(default=None, repr=False)  # states no stage may end at
    compression: list[str] = field(default_factory=list)
    #: whether every state is a prefix of the execution order (the states then form one chain)
    prefixes_only: bool = False
    _contains: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.forbidden is None:
            self.forbidden = np.zeros(len(self.masks), dtype=bool)

    def splits(self, group: set[Any]) -> np.ndarray:
        """Per state: whether its down-set holds some but not all of ``group``."""
        index = self.index
        columns = [index[v] for v in group if v in index]
        inside = self.membership[:, columns]
        return inside.any(axis=1) & ~inside.all(axis=1)

    def __len__(self) -> int:
        return len(self.masks)

    def down_set(self, state: int) -> list[Any]:
        """The nodes of a state, in execution order."""
        return [self.nodes[i] for i in np.flatnonzero(self.membership[state])]

    def antichain(self, state: int) -> list[Any]:
        """The maximal nodes of a state's down-set: the antichain that names it."""
        members = self.down_set(state)
        inside = set(members)
        return [v for v in members if not any(s in inside for s in self.graph.successors(v))]

    def cut(self, state: int) -> list[Any]:
        """Nodes inside the state whose outputs are needed outside it."""
        return [self.nodes[i] for i in np.flatnonzero(self.cut_membership[state])]

    def contains(self) -> np.ndarray:
        """Boolean matrix ``C[j, i]``: state i's down-set is a strict subset of state j's. Made
        once: the program asks for it per device kind and per count of micro-batches a stage holds
        (16 times for 16 stages under 1F1B), and on 5000 states it takes seconds."""
        if self._contains is None:
            if self.prefixes_only:
                self._contains = np.tri(len(self), k=-1, dtype=bool)
            else:
                self._contains = self._containment()
        return self._contains

    def contains_between(self, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """``contains()[rows][:, columns]``, without the whole matrix where every state is a prefix."""
        if self.prefixes_only:
            return rows[:, None] > columns[None, :]
        return self.contains()[np.ix_(rows, columns)]

    def subset(self, states: Sequence[int]) -> StateSpace:
        """The space of ``states`` alone (increasing indices, the first and the last state among
        them): a chain through them is a chain of this space."""
        kept = np.asarray(states)
        if kept[0] != 0 or kept[-1] != len(self) - 1 or np.any(np.diff(kept) <= 0):
            raise ValueError("a subset of states keeps the first and the last, in increasing order")
        arrays = {name: getattr(self, name)[kept] for name in (
            "compute", "forward", "backward", "param_bytes", "frozen_bytes", "buffer_bytes", "activation_bytes",
            "cut_bytes", "membership", "cut_membership", "forbidden")}
        smaller = replace(self, masks=[self.masks[i] for i in kept], **arrays)
        if self._contains is not None:
            smaller._contains = self._contains[np.ix_(kept, kept)]
        return smaller

    def _containment(self) -> np.ndarray:
        index = self.index
        successors = [[index[s] for s in self.graph.successors(v)] for v in self.nodes]
        member = self.membership
        by_node = np.ascontiguousarray(member.T)  # a node's states in one row: the gathers below read rows
        has_successor_inside = np.zeros_like(by_node)
        for v, succ in enumerate(successors):
            if succ:
                has_successor_inside[v] = by_node[succ].any(axis=0)
        maximal = member & ~has_successor_inside.T
        contains = np.empty((len(self), len(self)), dtype=bool)
        for i in range(len(self)):
            contains[:, i] = by_node[np.flatnonzero(maximal[i])].all(axis=0)
        return np.tril(contains, k=-1)

    @property
    def index(self) -> dict[Any, int]:
        return {v: i for i, v in enumerate(self.nodes)}


def enumerate_down_sets(predecessors: Sequence[Sequence[int]], max_states: int | None = None) -> list[int]:
    """All down-sets of a DAG as bitmasks, smallest first, the empty set included.

    ``predecessors[v]`` lists the direct predecessors of node v; nodes must be numbered in a
    topological order. The search adds one ready node at a time (a node whose predecessors are all
    present), so it is iterative and visits each down-set once per way of reaching it. Raises
    :class:`TooManyStatesError` once more than ``max_states`` down-sets are found.

    >>> enumerate_down_sets([[], [0], [0], [1, 2]])  # a diamond
    [0, 1, 3, 5, 7, 15]
    """
    n = len(predecessors)
    pred_masks = [sum(1 << p for p in preds) for preds in predecessors]
    successors: list[list[int]] = [[] for _ in range(n)]
    for v, preds in enumerate(predecessors):
        for p in preds:
            if p >= v:
                raise ValueError("predecessors must be numbered in a topological order")
            successors[p].append(v)
    level: dict[int, tuple[int, ...]] = {0: tuple(v for v in range(n) if pred_masks[v] == 0)}
    found = [0]
    while level:
        next_level: dict[int, tuple[int, ...]] = {}
        for mask in sorted(level):
            ready = level[mask]
            for v in ready:
                new = mask | (1 << v)
                if new in next_level:
                    continue
                unlocked = tuple(s for s in successors[v] if pred_masks[s] & ~new == 0)
                next_level[new] = tuple(r for r in ready if r != v) + unlocked
        found.extend(sorted(next_level))
        if max_states is not None and len(found) > max_states:
            raise TooManyStatesError(f"more than {max_states} down-sets")
        level = next_level
    return found


def compress_branch_chains(graph: nx.DiGraph, order: dict[Any, int], pieces: int = 1) -> list[list[Any]]:
    """Groups of nodes to merge: each chain hanging off a fork becomes ``pieces`` groups at most.

    A chain starts at a successor (with one predecessor) of a node with several successors and
    runs while each node has one successor and the next has one predecessor. Cuts inside a group
    are given up; that is what keeps the product of branch lengths from exploding. Every other node
    is its own group. Groups are listed in execution order.
    """
    group_of: dict[Any, int] = {}
    groups: list[list[Any]] = []
    for u in sorted(graph.nodes, key=order.__getitem__):
        if graph.out_degree(u) < 2:
            continue
        for start in sorted(graph.successors(u), key=order.__getitem__):
            if start in group_of or graph.in_degree(start) != 1:
                continue
            chain = [start]
            while graph.out_degree(chain[-1]) == 1:
                (nxt,) = graph.successors(chain[-1])
                if graph.in_degree(nxt) != 1 or nxt in group_of:
                    break
                chain.append(nxt)
            for part in np.array_split(np.arange(len(chain)), min(pieces, len(chain))):
                members = [chain[i] for i in part]
                for v in members:
                    group_of[v] = len(groups)
                groups.append(members)
    for v in graph.nodes:
        if v not in group_of:
            group_of[v] = len(groups)
            groups.append([v])
    return sorted(groups, key=lambda g: order[g[0]])


def build_state_space(graph: nx.DiGraph, max_states: int = DEFAULT_MAX_STATES) -> StateSpace:
    """The down-set states of a cost graph, compressed if needed to stay within ``max_states``.

    Pinned nodes (model inputs) are in every state. See the module docstring for the compression.
    """
    return state_space_of_normalized(normalize_cost_graph(graph, copy=False), max_states)


def state_space_of_normalized(graph: nx.DiGraph, max_states: int = DEFAULT_MAX_STATES) -> StateSpace:
    """:func:`build_state_space` of a graph :func:`normalize_cost_graph` has made (a partition's)."""
    nodes = ordered_nodes(graph)
    if not any(not graph.nodes[v]["pinned"] for v in nodes):
        raise ValueError("the cost graph has no operations besides its inputs")
    return _state_space(graph, _shape_states(graph, nodes, max_states))


@dataclass
class _ShapeStates:
    """What the states of a graph's shape are, whatever its times and sizes."""

    nodes: list[Any]
    masks: list[int]
    membership: np.ndarray
    cut_membership: np.ndarray
    compression: list[str]
    prefixes_only: bool
    #: per cut entry (a node in a state's cut): its state and its node, to sum the cuts' bytes
    cut_entries: tuple[np.ndarray, np.ndarray] = field(init=False)
    #: where every state is a prefix: the node each state adds to the one before it
    added: np.ndarray | None = field(init=False)

    def __post_init__(self) -> None:
        self.cut_entries = np.nonzero(self.cut_membership)
        self.added = (np.argmax(self.membership[1:] & ~self.membership[:-1], axis=1) if self.prefixes_only
                      else None)

    def totals(self, values: np.ndarray) -> np.ndarray:
        """Per state, the sum of ``values`` (one per node) over its nodes."""
        if self.added is not None:  # each state holds the one before it and one node more
            return np.cumsum(np.concatenate([[values[self.membership[0]].sum()], values[self.added]]))
        return self.membership.astype(np.float64) @ values

    def cut_totals(self, values: np.ndarray) -> np.ndarray:
        """Per state, the sum of ``values`` over the nodes in its cut."""
        states, members = self.cut_entries
        return np.bincount(states, weights=values[members], minlength=len(self.masks))


#: the states of the last few shapes planned (a layout search asks for one shape many times)
_SHAPES: OrderedDict[Hashable, _ShapeStates] = OrderedDict()
_SHAPES_KEPT = 2


def _shape_of(graph: nx.DiGraph, nodes: list[Any], max_states: int) -> Hashable:
    """Everything the states depend on: the nodes in order, the edges, the pinned inputs, the outputs."""
    return (tuple(nodes), tuple(graph.edges), tuple(bool(graph.nodes[v]["pinned"]) for v in nodes),
            tuple(graph.graph.get("outputs", [])), max_states)


def _shape_states(graph: nx.DiGraph, nodes: list[Any], max_states: int) -> _ShapeStates:
    key = _shape_of(graph, nodes, max_states)
    if key in _SHAPES:
        _SHAPES.move_to_end(key)
        return _SHAPES[key]
    found = _enumerated(graph, nodes, max_states)
    _SHAPES[key] = found
    while len(_SHAPES) > _SHAPES_KEPT:
        _SHAPES.popitem(last=False)
    return found


def _enumerated(graph: nx.DiGraph, nodes: list[Any], max_states: int) -> _ShapeStates:
    index = {v: i for i, v in enumerate(nodes)}
    pinned_mask = sum(1 << index[v] for v in nodes if graph.nodes[v]["pinned"])
    free = [v for v in nodes if not graph.nodes[v]["pinned"]]
    compression: list[str] = []

    groups: list[list[Any]] = [[v] for v in free]
    masks = _try_enumerate(graph, groups, index, max_states)
    pieces = MAX_CHAIN_PIECES
    while masks is None and pieces >= 1:
        groups = compress_branch_chains(graph.subgraph(free), index, pieces)
        masks = _try_enumerate(graph, groups, index, max_states)
        pieces -= 1
    if len(groups) < len(free):
        compression.append(
            f"merged the chains inside parallel branches into at most {pieces + 1} piece(s) each: "
            f"{len(free)} -> {len(groups)} nodes" + ("" if masks is not None else ", still too many states")
        )
    prefixes_only = masks is None
    if masks is None:
        masks = []
        compression.append(
            f"more than {max_states} down-sets even after merging: cut only at prefixes of the execution order"
        )
    prefixes, mask = [], 0
    for v in free:
        mask |= 1 << index[v]
        prefixes.append(mask)
    all_masks = sorted({pinned_mask | m for m in [0, *masks, *prefixes]}, key=lambda m: (m.bit_count(), m))
    membership, cut_membership = _memberships(graph, nodes, all_masks)
    return _ShapeStates(nodes, all_masks, membership, cut_membership, compression, prefixes_only)


def _try_enumerate(
    graph: nx.DiGraph, groups: list[list[Any]], index: dict[Any, int], max_states: int
) -> list[int] | None:
    """Down-sets over the graph with each group contracted, as masks over the original nodes."""
    group_of = {v: g for g, members in enumerate(groups) for v in members}
    predecessors: list[list[int]] = []
    for members in groups:
        preds = {group_of[p] for v in members for p in graph.predecessors(v) if p in group_of}
        preds.discard(group_of[members[0]])
        predecessors.append(sorted(preds))
    try:
        down_sets = enumerate_down_sets(predecessors, max_states)
    except TooManyStatesError:
        return None
    group_masks = [sum(1 << index[v] for v in members) for members in groups]
    result = []
    for down_set in down_sets:
        mask, g = 0, 0
        while down_set:
            if down_set & 1:
                mask |= group_masks[g]
            down_set >>= 1
            g += 1
        result.append(mask)
    return result


def _memberships(graph: nx.DiGraph, nodes: list[Any], masks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per state and node: whether the node is in the state, and whether it is in its cut."""
    n = len(nodes)
    index = {v: i for i, v in enumerate(nodes)}
    nbytes = (n + 7) // 8
    membership = np.stack(
        [
            np.unpackbits(np.frombuffer(m.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")[:n]
            for m in masks
        ]
    ).astype(bool)
    outputs = {index[v] for v in graph.graph.get("outputs", []) if v in index}
    needed_outside = np.zeros_like(membership)
    for v, name in enumerate(nodes):
        succ = [index[s] for s in graph.successors(name)]
        if v in outputs:
            needed_outside[:, v] = True
        elif succ:
            needed_outside[:, v] = ~membership[:, succ].all(axis=1)
    return membership, membership & needed_outside


def _state_space(graph: nx.DiGraph, shape: _ShapeStates) -> StateSpace:
    nodes = shape.nodes
    attr = lambda key: np.array([float(graph.nodes[v][key]) for v in nodes])  # noqa: E731
    compute = np.array([node_compute(graph, v) for v in nodes])
    totals = shape.totals
    return StateSpace(
        graph=graph,
        nodes=nodes,
        masks=shape.masks,
        compute=totals(compute),
        forward=totals(attr("forward_s")),
        backward=totals(attr("backward_s")),
        param_bytes=totals(attr("param_bytes")),
        frozen_bytes=totals(attr("frozen_bytes")),
        buffer_bytes=totals(attr("buffer_bytes")),
        activation_bytes=totals(attr("saved_bytes")),
        cut_bytes=shape.cut_totals(attr("output_bytes")),
        membership=shape.membership,
        cut_membership=shape.cut_membership,
        compression=list(shape.compression),
        prefixes_only=shape.prefixes_only,
    )

