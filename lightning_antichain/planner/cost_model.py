"""The cost model: what a set of operations costs as a pipeline stage on a device.

A stage costs its compute (forward + backward, divided by its device's speed) plus shipping its
input and output cuts both ways over the link; its memory is its parameters with their gradients
and optimizer state, its buffers, and what it keeps for backward under the recompute mode. The
DP, the baselines and the plan all cost stages here, so they are compared on one model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from ..plans.plan import RECOMPUTE_MODES, Stage
from .cost_graph import block_param_bytes, trained_tensors


class InfeasiblePlanError(ValueError):
    """No split satisfies the request; the message names the limit and the stage. ``layouts``:
    where a search of layouts found none, every candidate it weighed, with why it could not run."""

    layouts: list[dict] = []
    #: where a stage's memory decided it: the least a rank would need, and its limit, in bytes
    needed_bytes: int | None = None
    limit_bytes: int | None = None


@dataclass(frozen=True)
class DeviceSpec:
    """A device a stage can run on: relative ``speed`` (2.0 = twice as fast) and memory in bytes."""

    name: str = "cpu"
    speed: float = 1.0
    memory_bytes: float | None = None


@dataclass(frozen=True)
class CostModel:
    """How a set of operations turns into stage time and memory.

    ``bandwidth`` is bytes per second between neighbouring stages (``inf``: free transfers, as
    between CPU devices that share memory). ``optimizer_multiplier`` is optimizer state per
    parameter byte: 0 for SGD, 1 for SGD with momentum, 2 for Adam. ``held`` is, by stage index,
    how many micro-batches the schedule has in flight on that stage at most
    (:func:`~lightning_antichain.plans.schedule.in_flight`: ``K - k`` under 1F1B); empty: all
    ``chunks``, as under GPipe. ``joined_output_bytes``: what the first stage's device also holds
    where one process joins the micro-batches' outputs there (the whole batch's output and its
    gradient; 0 where each micro-batch's loss is taken apart, as with stages as processes).
    ``loss_workspace_bytes``: what the loss's own computation holds there at its backward beyond
    that output and its gradient (a cross-entropy's log-softmax and its gradient, a squared
    error's square and its gradient), which meets whatever the stage keeps at that moment.
    ``accumulate_s_per_byte``: what a backward adds per trainable parameter byte where it adds
    into the gradients of the stage's earlier ones (:attr:`Plan.accumulate_s_per_byte`), and
    ``accumulate_grad_batches`` the batches Lightning accumulates them over (:attr:`Plan.accumulate_grad_batches`).
    """

    chunks: int = 1
    bandwidth: float = math.inf
    optimizer_multiplier: float = 2.0
    recompute: str = "never"
    held: tuple[int, ...] = ()
    joined_output_bytes: float = 0.0
    loss_workspace_bytes: float = 0.0
    accumulate_s_per_byte: float = 0.0
    accumulate_grad_batches: int = 1

    def held_by(self, index: int | None) -> int:
        """Micro-batches stage ``index`` holds at most (``None``: the most any stage holds)."""
        if not self.held:
            return self.chunks
        return max(self.held) if index is None else self.held[index]

    def accumulation_s(self, trainable_bytes: float | np.ndarray) -> Any:
        """What adding into gradients costs a stage of ``trainable_bytes`` per micro-batch, on
        average over a step: every backward but the first of its ``chunks`` adds, and the first too
        in every batch of Lightning's ``accumulate_grad_batches`` but the window's first."""
        adding = self.chunks - 1 / self.accumulate_grad_batches
        return self.accumulate_s_per_byte * trainable_bytes * adding / self.chunks

    def transfer_s(self, nbytes: float | np.ndarray) -> Any:
        """Seconds to ship ``nbytes`` forward and its gradient back."""
        return 2.0 * nbytes / self.bandwidth

    def memory_bytes(self, params: Any, buffers: Any, activations: Any, inputs: Any, frozen: Any = 0,
                     index: int | None = None, first: Any = False) -> Any:
        """The peak of stage ``index`` (``None``: of whichever stage holds the most micro-batches):
        parameters with their gradients and optimizer state (none for the ``frozen`` part of
        ``params``, which trains no gradient: a LoRA model's base), buffers, and what it keeps for
        backward. Without recomputation that is the ``activations`` (inputs included) of every
        micro-batch it holds at once (:meth:`held_by`). With it, the peak comes at a backward,
        which recomputes one micro-batch's activations while the others keep only their
        ``inputs``; ``"except_last"`` and ``"always"`` meet the same peak there. ``first``: whether
        the stage is the first (an array: per stage), which also holds the joined output and the
        loss's workspace (:meth:`loss_side_bytes`)."""
        held = self.held_bytes(activations, inputs, index)
        beside = self.loss_side_bytes(activations, inputs, index, first)
        return (params - frozen) * (2.0 + self.optimizer_multiplier) + frozen + buffers + held + beside

    def held_bytes(self, activations: Any, inputs: Any, index: int | None = None) -> Any:
        """What stage ``index`` keeps for backward at its peak (see :meth:`memory_bytes`)."""
        count = self.held_by(index)
        recomputes = self.recompute != "never" and count > 1
        return inputs * (count - 1) + activations if recomputes else activations * count

    def loss_side_bytes(self, activations: Any, inputs: Any, index: int | None = None, first: Any = False) -> Any:
        """What the whole batch's loss adds to the first stage's peak on its device: the joined
        output and its gradient, and the loss's workspace as far as it rises above the stage's own
        peak. The loss's backward comes before any stage's, when the stage keeps all it holds
        (``"never"``, and ``"except_last"``, whose last micro-batch is kept whole), or only its
        micro-batches' inputs (``"always"``, whose peak comes later, at a recomputation)."""
        workspace: Any = self.loss_workspace_bytes
        if workspace and self.recompute == "always" and self.held_by(index) > 1:
            # inputs x count at the loss against inputs x (count - 1) + activations at the stage's peak
            workspace = np.maximum(0.0, inputs + workspace - activations)
        return (self.joined_output_bytes + workspace) * first


def module_span(graph: nx.DiGraph, nodes: Sequence[Any]) -> list[str]:
    """The modules of a stage's first and last operations (``model.layers.0.input_layernorm``,
    ``model.layers.7.self_attn.q_proj``), from what the capture recorded of each operation's
    module; empty where it recorded none (a cost graph made by hand)."""
    def module_of(v: Any) -> str:
        attrs = graph.nodes[v]
        if attrs.get("kind") == "call_module":
            return str(attrs.get("target") or "")
        return str(attrs.get("owner") or "")

    named = [m for m in (module_of(v) for v in nodes if not graph.nodes[v]["pinned"]) if m]
    return [named[0], named[-1]] if named else []


def checked_mode(recompute: str) -> str:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    return recompute


def device_specs(
    stages: int,
    devices: Sequence[str | DeviceSpec] | None,
    speeds: Sequence[float] | None,
    memory_gb: float | Sequence[float | None] | None,
) -> list[DeviceSpec]:
    names = list(devices) if devices is not None else ["cpu"] * stages
    if len(names) != stages:
        raise ValueError(f"got {len(names)} devices for {stages} stages; give one device per stage")
    specs = [d if isinstance(d, DeviceSpec) else DeviceSpec(str(d)) for d in names]
    if speeds is not None:
        if len(speeds) != stages or any(s <= 0 for s in speeds):
            raise ValueError(f"speeds needs {stages} positive values, got {list(speeds)}")
        specs = [DeviceSpec(d.name, float(s), d.memory_bytes) for d, s in zip(specs, speeds, strict=False)]
    if memory_gb is not None:
        limits = [memory_gb] * stages if isinstance(memory_gb, (int, float)) else list(memory_gb)
        if len(limits) != stages:
            raise ValueError(f"memory_gb needs one value or {stages}, got {len(limits)}")
        specs = [
            DeviceSpec(d.name, d.speed, None if m is None else float(m) * 1e9)
            for d, m in zip(specs, limits, strict=False)
        ]
    return specs


def memory_of(graph: nx.DiGraph, nodes: list[Any], model: CostModel) -> float:
    attr = lambda key: sum(graph.nodes[v][key] for v in nodes)  # noqa: E731
    cut_in = list(dict.fromkeys(p for v in nodes for p in graph.predecessors(v) if p not in nodes))
    activations, inputs = kept_bytes(graph, nodes, cut_in, nodes)
    return model.memory_bytes(attr("param_bytes"), attr("buffer_bytes"), activations, inputs, attr("frozen_bytes"))


def kept_bytes(graph: nx.DiGraph, nodes: Sequence[Any], cut_in: Sequence[Any], cut_out: Sequence[Any]
               ) -> tuple[int, int]:
    """What a stage keeps per micro-batch for backward, and what it keeps of a recomputed one.

    With counted saved tensors: the union of the storages its operations save and of its input and
    output cuts' storages (each storage once), the copies of the inputs it changes in place (the
    runtime changes a copy), and the input cuts' storages. Otherwise: every output of its
    operations and its input cut, and the input cut.
    """
    if graph.graph.get("saved_counted"):
        inputs = {k: b for v in cut_in for k, b in graph.nodes[v]["storages"].items()}
        kept = dict(inputs)
        for v in nodes:
            kept.update(graph.nodes[v]["saved"])
        for v in cut_out:
            kept.update(graph.nodes[v]["storages"])
        changed = {k for v in nodes for k in graph.nodes[v].get("mutates", ())} & set(inputs)
        return sum(kept.values()) + sum(inputs[k] for k in changed), sum(inputs.values())
    in_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_in)
    own = sum(graph.nodes[v]["output_bytes"] for v in nodes if not graph.nodes[v]["pinned"])
    return own + in_bytes, in_bytes


def evaluate_stages(
    graph: nx.DiGraph, stage_nodes: Sequence[Sequence[Any]], specs: Sequence[DeviceSpec], model: CostModel
) -> list[Stage]:
    """Cost each stage of a split directly from the graph (the program's arrays are not used).

    A stage's input cut is every node before it whose output is still needed at or after it; its
    output cut is every node up to it whose output is still needed after it. Tensors that skip a
    stage are relayed through it, so they count in both of its cuts.
    """
    outputs = set(graph.graph.get("outputs", []))
    seen: set[Any] = {v for v in graph.nodes if graph.nodes[v]["pinned"]}
    built: list[Stage] = []

    def cut(candidates: set[Any], inside: set[Any]) -> list[Any]:
        """Of ``candidates`` (in ``inside``), those whose outputs are needed outside ``inside``."""
        return [
            v
            for v in ordered_nodes_of(graph, candidates)
            if v in outputs or any(s not in inside for s in graph.successors(v))
        ]

    cut_in = cut(seen, seen)
    for k, (nodes, spec) in enumerate(zip(stage_nodes, specs, strict=False)):
        seen |= set(nodes)
        if not any(not graph.nodes[v]["pinned"] for v in nodes):
            raise InfeasiblePlanError(f"stage {k} is empty")
        for v in nodes:
            missing = [p for p in graph.predecessors(v) if p not in seen]
            if missing:
                raise InfeasiblePlanError(f"stage {k} runs {v!r} before its inputs {missing} are computed")
        cut_out = cut(set(cut_in) | set(nodes), seen)  # what an earlier stage's cut did not need, nothing later does
        in_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_in)
        out_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_out)
        sum_attr = lambda key: sum(graph.nodes[v][key] for v in nodes if not graph.nodes[v]["pinned"])  # noqa: E731,B023
        activations, kept_inputs = kept_bytes(graph, nodes, cut_in, cut_out)
        largest_block, unblocked, blocks = block_param_bytes(graph, [v for v in nodes if not graph.nodes[v]["pinned"]])
        built.append(
            Stage(
                index=k,
                device=spec.name,
                nodes=[str(v) for v in nodes],
                forward_s=sum_attr("forward_s") / spec.speed,
                backward_s=sum_attr("backward_s") / spec.speed,
                transfer_s=float(model.transfer_s(in_bytes + out_bytes)),
                memory_bytes=int(model.memory_bytes(sum_attr("param_bytes"), sum_attr("buffer_bytes"), activations,
                                                    kept_inputs, sum_attr("frozen_bytes"), index=k, first=k == 0)),
                joined_output_bytes=int(model.joined_output_bytes) if k == 0 else 0,
                loss_workspace_bytes=int(model.loss_side_bytes(activations, kept_inputs, k, k == 0)
                                         - (model.joined_output_bytes if k == 0 else 0)),
                param_bytes=int(sum_attr("param_bytes")),
                largest_block_bytes=largest_block,
                unblocked_param_bytes=unblocked,
                param_blocks=blocks,
                param_tensors=trained_tensors(graph, nodes),
                frozen_bytes=int(sum_attr("frozen_bytes")),
                modules=module_span(graph, nodes),
                buffer_bytes=int(sum_attr("buffer_bytes")),
                activation_bytes=int(activations),
                input_bytes=int(in_bytes),
                kept_input_bytes=int(kept_inputs),
                output_bytes=int(out_bytes),
                inputs=[str(v) for v in cut_in],
                outputs=[str(v) for v in cut_out],
                speed=spec.speed,
                memory_limit_bytes=None if spec.memory_bytes is None else int(spec.memory_bytes),
            )
        )
        cut_in = cut_out
    return built


def ordered_nodes_of(graph: nx.DiGraph, nodes: set[Any]) -> list[Any]:
    return sorted(nodes, key=lambda v: graph.nodes[v]["order"])
