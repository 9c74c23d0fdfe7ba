"""What the runtime itself costs on a device, apart from the model's operations.

Each micro-batch a stage runs passes through the engine: a queue hand-off, the stage's graph
module, detaching its outputs and the autograd plumbing that joins the micro-batches. Each step adds
splitting the batch and joining the outputs. And each micro-batch's backward after a stage's first
adds its gradients into those already there, a pass over the stage's parameters that the profile's
backwards, into empty gradients, do not make (a wide MLP's stage: 12-15 ms a backward after the
first, 8.5 the first, 6.4 profiled). Per-op profiles see none of this, so the planner charges it
separately: :func:`runtime_overhead` measures it once per machine, device type and torch version (a
pipeline of one stage against the same micro-batches run plainly; a backward adding into gradients
against one into empty gradients), and caches it next to the profiles.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.func import functional_call

from ..capture import OpGraph, capture
from ..capture.isolation import own_forward
from ..capture.pytrees import iter_tensors, map_tensors
from ..device import device_name, is_accelerator, synchronize
from ..in_process.pipeline import Pipeline
from .cache import DamagedEntry, default_cache_dir, entry_key, read_entry, write_entry
from .contention import copied_buffers
from .optimizer_copies import optimizer_copies
from .partition import partition


@dataclass(frozen=True)
class RuntimeOverhead:
    """Seconds the runtime adds per task (one micro-batch's forward or backward on one stage) and
    per step; and per byte of trainable parameters, to a backward adding into their gradients."""

    task_s: float
    step_s: float
    accumulate_s_per_byte: float


_measured: dict[str, RuntimeOverhead] = {}


def runtime_overhead(device: str | torch.device = "cpu", cache_dir: Path | None = None) -> RuntimeOverhead:
    """The runtime's overhead on ``device``: from memory, else from the cache, else measured (about a second)."""
    device = torch.device(device)
    key = entry_key("overhead", device.type, device_name(device), os.cpu_count(), torch.__version__,
                    torch.get_num_threads())
    if key in _measured:
        return _measured[key]
    directory = cache_dir or default_cache_dir()
    found = read_entry(directory, "overhead", key, _parsed)
    if found is None:
        found = measure_runtime_overhead(device)
        write_entry(directory, "overhead", key, asdict(found))
    _measured[key] = found
    return found


def charge_runtime_overhead(cost: nx.DiGraph, device: str | torch.device) -> None:
    """Write the runtime's overhead on ``device`` into the cost graph, where the planner reads it."""
    found = runtime_overhead(device)
    cost.graph.update(task_overhead_s=found.task_s, step_overhead_s=found.step_s,
                      accumulate_s_per_byte=found.accumulate_s_per_byte)


def measure_runtime_overhead(device: torch.device, repeats: int = 15, chunks: int = 8,
                             blocks: int = 3) -> RuntimeOverhead:
    """Fit ``step_s + 2 * chunks * task_s`` to a one-stage pipeline's extra time over plain training
    on the same micro-batches, at 1 and at ``chunks`` micro-batches: in ``blocks`` blocks of the
    repeats, each term the least of the blocks' medians. A busy moment of a shared machine only
    adds time, and the result is cached for the machine: one inflated measurement would otherwise
    take every later plan's tasks for runtime (a tiny model's calibrated stage times fell to 0)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8)).to(device)
    x = torch.randn(4 * chunks, 8, device=device)
    cost = _untimed_cost_graph(capture(module, x[:4]))
    pipes = {m: Pipeline(module, partition(cost, 1, chunks=m, devices=[str(device)]), chunks=m) for m in (1, chunks)}

    def plain(m: int) -> Callable[[], None]:
        return lambda: [module(part).sum().backward() for part in torch.tensor_split(x, m)]

    variants = {("plain", m): plain(m) for m in pipes} | {
        ("pipe", m): (lambda p=pipe: p(x).sum().backward()) for m, pipe in pipes.items()
    }
    times: dict[tuple[str, int], list[float]] = {name: [] for name in variants}
    try:
        for i in range(repeats + 2):
            for name, run in variants.items():
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
    finally:
        for pipe in pipes.values():
            pipe.close()
    fits = []
    size = max(1, repeats // blocks)
    for b in range(0, repeats - size + 1, size):
        block = {name: statistics.median(values[b : b + size]) for name, values in times.items()}
        extra = {m: block["pipe", m] - block["plain", m] for m in pipes}
        task_s = max(0.0, (extra[chunks] - extra[1]) / (2 * (chunks - 1)))
        fits.append((task_s, max(0.0, extra[1] - 2 * task_s)))
    return RuntimeOverhead(task_s=min(f[0] for f in fits), step_s=min(f[1] for f in fits),
                           accumulate_s_per_byte=measure_accumulation_rate(device))


def measure_accumulation_rate(device: torch.device, repeats: int = 15) -> float:
    """Seconds per parameter byte that a backward adding into gradients already there takes over
    one into empty gradients: a linear layer's, in interleaved pairs; the difference of their
    medians, over the weight's bytes. Timed with the allocator the runtime has, since memory reused
    and memory fresh cost differently (a fresh 100 MB of gradients paged in cost more than the
    add). The layer is the size of a model's large weight, past the caches: on a CPU 16 MiB, under
    the size that glibc maps afresh even where the runtime keeps freed memory
    (:mod:`~lightning_antichain.cpu_allocator`: 0.15-0.18 ns a byte here at 16 and 32 MiB, 0.46-0.52 at
    64, against 0.18-0.19 in three models' backwards), and 256 MiB on an accelerator."""
    megabytes = 256 if is_accelerator(device) else 16
    side = math.isqrt(megabytes * 2**20 // 4)
    layer = nn.Linear(side, side, bias=False, device=device)
    x = torch.randn(1, side, device=device)
    empty: list[float] = []
    adding: list[float] = []
    for i in range(repeats + 1):  # the first warms up
        layer.weight.grad = None
        for found in (empty, adding):
            loss = layer(x).sum()
            synchronize(device)
            start = time.perf_counter()
            loss.backward()
            synchronize(device)
            if i:
                found.append(time.perf_counter() - start)
    size = layer.weight.numel() * layer.weight.element_size()
    return max(0.0, statistics.median(adding) - statistics.median(empty)) / size


def _untimed_cost_graph(graph: OpGraph) -> nx.DiGraph:
    """The cost graph of ``graph`` with every cost zero: enough to place it on one stage."""
    cost = nx.DiGraph(outputs=list(graph.outputs))
    for order, node in enumerate(graph.nodes):
        cost.add_node(node.name, order=order, pinned=node.kind == "placeholder")
        cost.add_edges_from((src, node.name) for src in (*node.inputs, *node.after))
    return cost


def _parsed(data: Any) -> RuntimeOverhead:
    found = RuntimeOverhead(float(data["task_s"]), float(data["step_s"]), float(data["accumulate_s_per_byte"]))
    if min(found.task_s, found.step_s, found.accumulate_s_per_byte) < 0:
        raise DamagedEntry("it has a negative overhead")
    return found


def optimizer_step_s(optimizers: list[torch.optim.Optimizer], budget_bytes: int = 256 * 2**20,
                     device: torch.device | None = None) -> float:
    """Seconds one ``step()`` of ``optimizers`` takes, measured on copies of their parameters.

    A fresh optimizer of the same class and settings steps copies of the parameters (with state, as
    after the first step), and of their gradients where they have them (random ones where not: on
    CPU, values change the time); beyond ``budget_bytes`` of parameters it steps the first ones
    only and scales by bytes, so planning a large model does not double its memory. An optimizer
    that cannot be rebuilt from its parameter groups counts as free. The copies are made on
    ``device`` where one is named (the profiling device, for a model that waits elsewhere).
    Parameters on the meta device (a model built without memory) are stood in for by random ones,
    at most an eighth of them and a quarter of ``budget_bytes``.
    """
    total = 0.0
    for fresh, scale in optimizer_copies(optimizers, budget_bytes, device):
        devices = {p.device for g in fresh.param_groups for p in g["params"]}
        times = []
        for _ in range(4):
            synchronize(devices)
            start = time.perf_counter()
            fresh.step()
            synchronize(devices)
            times.append(time.perf_counter() - start)
        total += statistics.median(times[1:]) * scale
    return total


def loss_seconds(module: nn.Module, args: tuple, kwargs: dict, loss: Callable[[Any], torch.Tensor | None]
                 ) -> tuple[float, float] | None:
    """Seconds of ``loss`` on the module's output for the call ``args, kwargs`` (where the module
    is): its forward and its backward to the output, what the last stage's rank adds to each
    micro-batch beyond the model; ``None`` for a module without values (on meta), or where
    ``loss`` gives none for the output."""
    state = [*module.parameters(), *module.buffers()]
    if any(t.is_meta for t in state):
        return None
    device = state[0].device if state else torch.device("cpu")
    with torch.no_grad(), own_forward(module):  # the loss may call the forward a strategy installed
        output = functional_call(module, copied_buffers(module), args, kwargs)
    leaves = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), output)
    # the gradients handed back, as to the model's last operation: none gathered in a leaf's
    # .grad, whose adding there (a 16 MB logits' gradient) tripled a loss's backward
    inputs = [t for t in iter_tensors(leaves) if t.requires_grad]
    forwards, backwards = [], []
    for i in range(4):
        synchronize(device)
        started = time.perf_counter()
        value = loss(leaves)
        if value is None:
            return None
        synchronize(device)
        middle = time.perf_counter()
        if inputs and value.requires_grad:
            torch.autograd.grad(value, inputs, allow_unused=True)
        synchronize(device)
        if i:  # the first to warm up
            forwards.append(middle - started)
            backwards.append(time.perf_counter() - middle)
    return statistics.median(forwards), statistics.median(backwards)
