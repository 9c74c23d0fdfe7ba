"""The cost graph of a model of many repeated blocks, from that of the same model with few.

Capturing a decoder costs time in proportion to its layers (torch.export takes about half a
second a layer: a 405 B Llama's 126 layers over a minute), though every layer after the first few
repeats an earlier one operation for operation. Planning from a config therefore captures the
model with the fewest layers that show each kind of layer twice (:func:`fewest_layers`), costs
it, and extends its cost graph to the config's depth here: each added block is a copy of the last
captured block of its kind, with the nodes, parameters and storages it names renamed to its own
index, wired to the block before it as the block it copies is to its own predecessor. The
operations after the blocks then read the last block. The result is the cost graph the whole
model's capture would give, but for the node names of the added blocks.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
from torch import nn

from .cost_graph import block_of_node, ordered_nodes


@dataclass(frozen=True)
class Depth:
    """A model captured with the first ``captured`` of its ``wanted`` blocks, the module list at
    ``path`` (``model.layers``), which repeat with ``period`` (:func:`fewest_layers`)."""

    path: str
    captured: int
    wanted: int
    period: int = 1

    def extend(self, cost: nx.DiGraph) -> nx.DiGraph:
        """``cost`` with every block the capture left out (:func:`with_blocks_repeated`)."""
        return with_blocks_repeated(cost, self.path + ".", self.captured, self.wanted, self.period)

    def added_trainable_bytes(self, module: nn.Module) -> int:
        """The trainable parameters' bytes of the blocks the capture left out."""
        blocks = module.get_submodule(self.path)
        total = 0
        for index in range(self.captured, self.wanted):
            copied = self.captured - self.period + (index - self.captured) % self.period
            total += sum(p.numel() * p.element_size() for p in blocks[copied].parameters() if p.requires_grad)
        return total


def repeating_tail(kinds: Sequence[Any]) -> tuple[int, int] | None:
    """Where the layers of ``kinds`` (in order) begin to repeat and with what period, the shortest
    period first and the earliest start: ``(first, period)``, or ``None`` where they do not."""
    total = len(kinds)
    for period in range(1, total // 2 + 1):
        for first in range(0, total - 2 * period + 1):
            tail = kinds[first:]
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                return first, period
    return None


def fewest_layers(kinds: Sequence[Any]) -> int:
    """The fewest leading layers of a model whose layers are of ``kinds`` (in order) from which
    the rest follow by repetition: a first part that does not repeat, then two periods of the
    part that does, plus what makes the layers left a whole number of periods; all of them where
    that is no fewer."""
    found = repeating_tail(kinds)
    if found is None:
        return len(kinds)
    first, period = found
    return min(first + 2 * period + (len(kinds) - first) % period, len(kinds))


def period_of(kinds: Sequence[Any]) -> int:
    """The period with which ``kinds`` repeat after their first part (:func:`fewest_layers`)."""
    found = repeating_tail(kinds)
    return 1 if found is None else found[1]


def with_blocks_repeated(cost: nx.DiGraph, prefix: str, captured: int, wanted: int, period: int = 1) -> nx.DiGraph:
    """``cost`` (a cost graph whose blocks ``{prefix}0`` .. ``{prefix}{captured - 1}`` repeat with
    ``period`` from some block on) extended to ``wanted`` blocks: see the module's docstring."""
    if wanted <= captured:
        return cost
    if (wanted - captured) % period or captured < 2 * period:
        raise ValueError(f"{captured} captured blocks of period {period} do not extend to {wanted}")
    blocks: dict[int, list[str]] = {}
    position: dict[str, tuple[int, int]] = {}
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    for name in ordered_nodes(cost):
        found = block_of_node(cost.nodes[name])
        matched = pattern.match(found) if found else None
        if matched:
            index = int(matched.group(1))
            position[name] = (index, len(blocks.setdefault(index, [])))
            blocks[index].append(name)
    if sorted(blocks) != list(range(captured)):
        raise ValueError(f"the cost graph's blocks under {prefix!r} are {sorted(blocks)}, not 0 .. {captured - 1}")
    for index in range(captured - period, captured):
        if len(blocks[index]) != len(blocks[index - period]):
            raise ValueError(f"{prefix}{index} does not repeat {prefix}{index - period} operation for operation")

    def source(index: int) -> int:
        """The captured block that block ``index`` copies: the last of its kind."""
        return captured - period + (index - captured) % period

    def node_in(index: int, at: int) -> str:
        return blocks[index][at] if index < captured else f"{blocks[source(index)][at]}_L{index}"

    extended = cost.copy()
    last = blocks[captured - 1]
    end = cost.nodes[last[-1]]["order"]
    after = {name for name in cost.nodes if name not in position and cost.nodes[name]["order"] > end}
    for index in range(captured, wanted):
        copied = source(index)

        def renamed(name: str, copied: int = copied, index: int = index) -> str:
            """A node's name as block ``index`` (copying block ``copied``) sees it."""
            found = position.get(name)
            if found is None:
                return name  # outside the blocks: shared, as the rotary tables and masks are
            block, at = found
            if block == copied:
                return node_in(index, at)
            if block == copied - 1:
                return node_in(index - 1, at)
            if block < copied - 1:  # made once by an early block and read by every later one (export shares it)
                return name
            raise ValueError(f"{name} of {prefix}{block} is read by {prefix}{copied}, an earlier block")

        paths = _path_renamer(f"{prefix}{copied}", f"{prefix}{index}")
        for at, name in enumerate(blocks[copied]):
            extended.add_node(node_in(index, at), **_renamed_attrs(cost.nodes[name], renamed, paths))
        for at, name in enumerate(blocks[copied]):
            for source_name, _, attrs in cost.in_edges(name, data=True):
                extended.add_edge(renamed(source_name), node_in(index, at), **copy.deepcopy(attrs))
    final = _final_renamer(position, captured, wanted, node_in)
    for name in after:
        attrs = extended.nodes[name]
        extended.nodes[name].update(_renamed_attrs(attrs, final, lambda path: path))
        for source_name, _, edge in list(cost.in_edges(name, data=True)):
            if final(source_name) != source_name:
                extended.remove_edge(source_name, name)
                extended.add_edge(final(source_name), name, **copy.deepcopy(edge))
    extended.graph["outputs"] = [final(n) for n in cost.graph.get("outputs", [])]
    _reorder(extended, cost, blocks, captured, wanted, source, node_in)
    repeated = dict(cost.graph.get("repeated_blocks") or {})
    for index in range(captured, wanted):
        reference = next((ref for ref, copies in repeated.items() if f"{prefix}{source(index)}" in copies),
                         f"{prefix}{source(index)}")
        repeated.setdefault(reference, []).append(f"{prefix}{index}")
    extended.graph.update(repeated_blocks=repeated, extended_from_blocks=captured)
    return extended


def _final_renamer(position: dict[str, tuple[int, int]], captured: int, wanted: int,
                   node_in: Callable[[int, int], str]) -> Callable[[str], str]:
    """What the operations after the blocks read: the last block's nodes are now those of the last copy."""

    def final(name: str) -> str:
        found = position.get(name)
        if found is None or found[0] != captured - 1:
            return name
        return node_in(wanted - 1, found[1])

    return final


def _path_renamer(old: str, new: str) -> Callable[[str], str]:
    pattern = re.compile(re.escape(old) + r"(?=\.|$)")
    return lambda path: pattern.sub(new, path, count=1) if isinstance(path, str) else path


def _storage(name: str, renamed: Callable[[str], str]) -> str:
    """A storage's name (its maker's node name, with ``#n`` or ``~...`` after it) renamed."""
    cut = min((i for i in (name.find("#"), name.find("~")) if i >= 0), default=len(name))
    return renamed(name[:cut]) + name[cut:]


def _renamed_attrs(attrs: dict[str, Any], renamed: Callable[[str], str],
                   paths: Callable[[str], str]) -> dict[str, Any]:
    found = copy.deepcopy(attrs)
    for key in ("saved", "storages"):
        if key in found:
            found[key] = {_storage(name, renamed): size for name, size in found[key].items()}
    if "mutates" in found:
        found["mutates"] = [_storage(name, renamed) for name in found["mutates"]]
    for key in ("params", "frozen_params", "uses"):
        if key in found:
            found[key] = [paths(name) for name in found[key]]
    for key in ("owner", "target"):
        if key in found:
            found[key] = paths(found[key])
    return found


def _reorder(extended: nx.DiGraph, cost: nx.DiGraph, blocks: dict[int, list[str]], captured: int, wanted: int,
             source: Callable[[int], int], node_in: Callable[[int, int], str]) -> None:
    """Execution order: what came up to the blocks' end, then the added blocks, then the rest."""
    end = cost.nodes[blocks[captured - 1][-1]]["order"]
    order = [n for n in ordered_nodes(cost) if cost.nodes[n]["order"] <= end]
    for index in range(captured, wanted):
        order.extend(node_in(index, at) for at in range(len(blocks[source(index)])))
    order.extend(n for n in ordered_nodes(cost) if cost.nodes[n]["order"] > end)
    for i, name in enumerate(order):
        extended.nodes[name]["order"] = i
