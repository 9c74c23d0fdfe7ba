"""The cost graph of a model on a GPU this machine does not have, from shapes alone.

The measured profile (:mod:`.profiler`) times each operation where it will run; where the plan is
for GPUs to be rented, this backend costs each operation on their roofline instead
(:mod:`.roofline`), running the captured graph once on meta tensors, one operation at a time
(:mod:`.just_in_time`: a block that repeats another takes its costs). It writes the same cost
graph, so the layout search reads its costs without knowing their source; the graph says which
it is (``cost_source``). Nothing runs at full size, so a 70 B model plans in seconds and in little
memory. The optimizer's step, the gradients' accumulation and the collectives are costed on the
same GPU's memory bandwidth and links.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..capture import OpGraph
from ..capture.isolation import keeps_random_state
from .deeper import Depth
from .just_in_time import profile_just_in_time
from .layout_cost import Links
from .profiler import _cost_graph, _time_once
from .progress import Progress
from .roofline import Efficiencies, FusedAttention, RooflineClock
from .target_devices import TargetDevice

#: the share of a GPU's memory a plan may fill, as for a GPU at hand (:func:`lightning_antichain.device.memory_gb`)
USABLE = 0.9


@dataclass(frozen=True)
class TargetModel:
    """A cost model of ranks on ``device`` GPUs, at the ``efficiencies`` its kernels reach."""

    device: TargetDevice
    efficiencies: Efficiencies = dataclasses.field(default_factory=Efficiencies)
    #: where the model was built with fewer of its repeated blocks than it has: the depth its
    #: cost graph is extended to (:mod:`.deeper`)
    depth: Depth | None = None

    @property
    def memory_gb(self) -> float:
        return USABLE * self.device.memory_gb

    def links(self, per_node: int, intranode_gbps: float | None = None, internode_gbps: float | None = None) -> Links:
        """The links between ranks, ``per_node`` to a node: the GPU's own (or those given, in
        GB/s), at the share of them a ring collective reaches (``efficiencies.link``)."""
        share = self.efficiencies.link
        within = intranode_gbps if intranode_gbps is not None else self.device.intranode_gbps
        across = internode_gbps if internode_gbps is not None else self.device.internode_gbps
        return Links(per_node, within * share, across * share, self.efficiencies.collective_s)

    def trainable_bytes(self, module: nn.Module) -> int:
        """The bytes of the model's trainable parameters, at its whole depth."""
        found = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return found + (self.depth.added_trainable_bytes(module) if self.depth is not None else 0)

    def optimizer_step_s(self, trainable_bytes: int, multiplier: float) -> float:
        """An elementwise optimizer's step over ``trainable_bytes`` of parameters with
        ``multiplier`` times their bytes of state (AdamW: 2): it reads the parameters, their
        gradients and the state, and writes the parameters and the state."""
        moved = trainable_bytes * (3 + 2 * multiplier)
        return moved / (self.device.hbm_gbps * 1e9 * self.efficiencies.memory["elementwise"])

    @keeps_random_state
    def profile(self, module: nn.Module, graph: OpGraph, args: tuple, kwargs: dict,
                batch_dim: int | Mapping[str, int] = 0, progress: bool = True, name: str | None = None) -> nx.DiGraph:
        """The cost graph of ``graph`` (captured from ``module``) on one micro-batch ``args,
        kwargs``, every operation costed on this GPU's roofline."""
        started = time.perf_counter()
        clock = RooflineClock(self.device, self.efficiencies)
        label = f"costing {name or type(module).__name__} on {self.device.name}"
        reporter = Progress(len(graph.nodes), enabled=progress, label=label, unit="ops")
        meta = torch.device("meta")
        with FusedAttention():  # what attention keeps for backward: the fused kernel's, as on the GPU
            streamed = profile_just_in_time(graph, args, kwargs, meta, lambda call: _time_once(call, clock), 1, 0,
                                            reporter.step)
        reporter.close()
        cost = _cost_graph(graph, module, streamed.calls, streamed.samples, streamed.kept, None, 1.0, name, meta,
                           args, kwargs, batch_dim, 0, 1, False, started)
        cost.graph["repeated_blocks"] = streamed.repeated
        if self.depth is not None:
            cost = self.depth.extend(cost)
        cost.graph.update(
            device=f"cuda ({self.device.name})", device_name=self.device.name, cost_source=self.source,
            just_in_time=True, cpu_cores=None,
            task_overhead_s=0.0, step_overhead_s=0.0,
            accumulate_s_per_byte=3 / (self.device.hbm_gbps * 1e9 * self.efficiencies.memory["elementwise"]))
        return cost

    @property
    def source(self) -> str:
        """Where the costs come from, for the plan to say."""
        return f"roofline of {self.device.name} ({self.device.source}); efficiencies {self.efficiencies.source}"

    def describe(self) -> dict[str, Any]:
        return {"device": dataclasses.asdict(self.device), "efficiencies": dataclasses.asdict(self.efficiencies)}
