"""Measure what each operation costs on the device it will run on.

For every node of an :class:`~lightning_antichain.capture.OpGraph` the profiler replays the node alone
on the concrete inputs it received in a real forward pass, and records the median forward time,
the median backward time, the bytes of its output and of the parameters it owns, and the storages
its backward keeps (:mod:`lightning_antichain.measure.saved_tensors`). Timing is
synchronised on CUDA. The result is a cost graph (see :mod:`lightning_antichain.planner.cost_graph`) that can be
saved and planned again without profiling.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..batches.batch_dims import batch_size_of
from ..batches.microbatch import MicroBatchError
from ..capture import OpGraph, RecordedCall, trace
from ..capture.carried import carry
from ..capture.devices import retarget_devices
from ..capture.isolation import keeps_random_state
from ..capture.pytrees import iter_tensors, map_tensors
from ..capture.signature import split_inputs
from ..device import device_name, shares_host, timed
from ..device import memory_gb as device_memory_gb
from ..measure.cpu_threads import cpu_cores
from ..measure.saved_tensors import saved_per_call, state_storages
from ..weights.materialize import has_meta_state
from . import overhead
from .contention import PairedSteps, training_step
from .cost_graph import GRAPH_FORMAT
from .just_in_time import profile_just_in_time
from .progress import Progress


@keeps_random_state
def profile(
    module: nn.Module,
    example_inputs: Any,
    device: str | torch.device = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    op_graph: OpGraph | None = None,
    fallback: str | None = "children",
    leaf_modules: Sequence[type | str] = (),
    progress: bool = True,
    name: str | None = None,
    batch_dim: int | Mapping[str, int] = 0,
    runtime_overhead: bool = True,
    just_in_time: bool | None = None,
) -> nx.DiGraph:
    """Profile ``module`` on ``device`` and return its cost graph.

    ``example_inputs`` is one micro-batch, following Lightning's ``example_input_array`` convention
    (a tensor, a tuple of positional arguments, or a dict of keyword arguments); its size on
    ``batch_dim`` (as for :class:`Pipeline`) is recorded as the micro-batch size the costs refer to.
    The module is copied to ``device`` for measurement, so the caller's module, its device and its
    gradients are left untouched.
    Forward and backward times are medians of ``repeats`` runs after ``warmup`` runs; the runs go
    round-robin over all operations so that a passing slowdown of the machine spreads over many
    operations instead of biasing one. Progress is shown on stderr unless ``progress=False``.

    What per-op times miss is measured too, for the planner's prediction of a step. On CPU, ops
    timed one by one add up to more than the model's own forward and backward (each replay pays
    its own autograd call, and its fresh tensors miss the allocator's warm memory: +50% for a
    CNN with large activations, 0-5% for ResNets), so every op's time is scaled by the whole
    model's measured time over their sum (``op_time_scale``): the ops keep their shares, the total
    is what a step measures. Also on CPU, how much work two stages get through when they run at
    once (``parallel_capacity``: the whole model's forward and backward on two threads at once
    against one, at this micro-batch size, since small micro-batches contend for the interpreter
    lock and large ones for memory bandwidth); and,
    unless ``runtime_overhead=False``, the runtime's own cost per task and per step on ``device``
    (:func:`lightning_antichain.planner.overhead.runtime_overhead`, measured once per machine).

    ``just_in_time`` profiles one operation at a time from a copy of the model on meta, its modules
    made real on ``device`` with random values just before each operation
    (:mod:`~lightning_antichain.planner.just_in_time`), so the device never holds the whole model;
    the measurements that need the whole model are left out. Default: for a model with state on
    meta, or one whose parameters and buffers take more than a quarter of the device's memory.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device)
    started = time.perf_counter()
    graph = op_graph or trace(module, example_inputs, fallback=fallback, leaf_modules=leaf_modules,
                              batch_dim=batch_dim, progress=progress)
    timer = functools.partial(timed, device)
    label = f"profiling {name or type(module).__name__}"
    if just_in_time is None:
        just_in_time = has_meta_state(module) or _too_big_for(module, device)
    if just_in_time:
        args, kwargs = split_inputs(example_inputs)
        streamed = _profile_streamed(graph, module, args, kwargs, device, timer, warmup, repeats, progress, label)
        calls, samples, kept = streamed.calls, streamed.samples, streamed.kept
        capacity, scale = None, 1.0  # both need whole-model runs
        just_in_time = {"just_in_time": True, "profile_peak_bytes": streamed.peak_bytes,
                        "repeated_blocks": streamed.repeated}
    else:
        args, kwargs = split_inputs(map_tensors(lambda t: t.to(device), example_inputs))
        calls, samples, kept, capacity, scale = _profile_whole(graph, module, args, kwargs, device, timer, warmup,
                                                               repeats, progress, label)
        just_in_time = {"just_in_time": False}
    cost = _cost_graph(graph, module, calls, samples, kept, capacity, scale, name, device, args, kwargs, batch_dim,
                       warmup, repeats, runtime_overhead, started)
    cost.graph.update(just_in_time)
    carry(cost, graph)  # a Pipeline given a plan made from this profile runs this capture
    return cost


def _profile_streamed(graph: OpGraph, module: nn.Module, args: tuple, kwargs: dict, device: torch.device,
                      timer: Callable[..., Any], warmup: int, repeats: int, progress: bool, label: str) -> Any:
    """Every operation of ``graph`` timed from a copy of ``module`` on meta, one at a time
    (:mod:`~lightning_antichain.planner.just_in_time`)."""
    if graph.graph_module is None:
        raise ValueError(
            f"{type(module).__name__} is profiled operation by operation (it is on the meta device, or too "
            f"big for {device}), which needs its captured graph, but it could not be captured ({graph.note}). "
            "Make it capturable (see docs/capture.md)."
        )
    reporter = Progress(len(graph.nodes) * (warmup + repeats), enabled=progress, label=label, unit="op runs")
    streamed = profile_just_in_time(graph, args, kwargs, device, lambda call: _time_once(call, timer),
                                    warmup + repeats, warmup, reporter.step)
    reporter.close()
    return streamed


def _too_big_for(module: nn.Module, device: torch.device) -> bool:
    """Whether a copy of ``module`` would take more than a quarter of ``device``'s memory."""
    limit = device_memory_gb(device)
    state = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return limit is not None and state > limit * 1e9 / 4


def _profile_whole(graph: OpGraph, module: nn.Module, args: tuple, kwargs: dict, device: torch.device,
                   timer: Callable[[Callable[[], Any]], tuple[float, Any]], warmup: int, repeats: int,
                   progress: bool, label: str) -> tuple[list[RecordedCall], list[list[tuple[float, float]]],
                                                        list[Any], float | None, float]:
    """Record one forward pass of a copy of the whole model on ``device``, then time every operation
    round-robin; on a device that shares the host, also measure what per-op times miss."""
    work_module = copy.deepcopy(graph.graph_module if graph.graph_module is not None else module)
    work_module.to(device).train()
    if graph.graph_module is not None:
        retarget_devices(work_module, graph.capture_device, device)
    replay = graph.rebound(work_module if graph.graph_module is not None else None, work_module)
    with torch.enable_grad():
        calls = list(replay.record_calls(*args, **kwargs))
        kept = saved_per_call(calls, state_storages(work_module))
    rounds = warmup + repeats
    reporter = Progress(len(calls) * rounds, enabled=progress, label=label, unit="op runs")
    samples = [[] for _ in calls]
    capacity, scale = None, 1.0
    with _whole_steps(work_module, replay, graph, args, kwargs, device) as whole:
        # Round-robin over all ops, rather than op after op, and the whole step's rounds spread
        # among them: a slow spell of the machine then touches one sample of many ops, and a few
        # of the whole step's, instead of every sample of one.
        whole_rounds = 1 + max(1, min(5, repeats))
        for round_index in range(rounds):
            for call, measured in zip(calls, samples):
                timing = _time_once(call, timer)
                if round_index >= warmup:
                    measured.append(timing)
                reporter.step()
            if whole is not None:
                for _ in range(whole_rounds * (round_index + 1) // rounds - whole_rounds * round_index // rounds):
                    whole.round()
        reporter.close()
        if whole is not None:
            capacity, whole_s = whole.result()
            ops_s = sum(statistics.median(t[0] for t in m) + statistics.median(t[1] for t in m) for m in samples)
            scale = whole_s / ops_s if ops_s > 0 else 1.0
    return calls, samples, kept, capacity, scale


def _whole_steps(work_module: nn.Module, replay: OpGraph, graph: OpGraph, args: tuple, kwargs: dict,
                 device: torch.device) -> contextlib.AbstractContextManager[PairedSteps | None]:
    """On a device that shares the host, the whole model's training step timed alone and on two
    threads at once, for what per-op times miss; elsewhere nothing."""
    if not shares_host(device):
        return contextlib.nullcontext()
    call_args, call_kwargs = (replay.bind(args, kwargs), {}) if graph.graph_module is not None else (args, kwargs)
    return PairedSteps([training_step(work_module, *map_tensors(torch.Tensor.clone, (tuple(call_args), call_kwargs)))
                        for _ in range(2)])


def _cost_graph(graph: OpGraph, module: nn.Module, calls: list[RecordedCall], samples: list[list[tuple[float, float]]],
                kept: list[Any], capacity: float | None, scale: float, name: str | None, device: torch.device,
                args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int], warmup: int, repeats: int,
                runtime_overhead: bool, started: float) -> nx.DiGraph:
    """The cost graph of the measured calls."""
    cost = nx.DiGraph()
    owned: set[int] = set()
    canonical: dict[int, str] = {}
    for order, (call, measured, memory) in enumerate(zip(calls, samples, kept)):
        params, buffers = _owned_state(call, owned)
        for param_name, param in params:
            canonical.setdefault(id(param), param_name)
        node = call.node
        cost.add_node(
            node.name,
            order=order,
            kind=node.kind,
            target=node.target,
            owner=node.owner,
            top_level=node.top_level,
            forward_s=scale * statistics.median(t[0] for t in measured),
            backward_s=scale * statistics.median(t[1] for t in measured),
            output_bytes=_nbytes(call.output),
            saved=memory.saved,
            storages=memory.storages,
            mutates=memory.mutated,
            saved_bytes=memory.owned_saved_bytes,
            param_bytes=sum(p.numel() * p.element_size() for _, p in params),
            frozen_bytes=sum(p.numel() * p.element_size() for _, p in params if not p.requires_grad),
            buffer_bytes=sum(b.numel() * b.element_size() for _, b in buffers),
            params=[name for name, _ in params],
            frozen_params=[name for name, p in params if not p.requires_grad],
            uses=sorted({canonical[id(p)] for p in _used_parameters(call) if id(p) in canonical}),
            pinned=node.kind == "placeholder",
        )
        for src in node.inputs:
            cost.add_edge(src, node.name)
        for src in node.after:  # an in-place operation and the readers of what it changes
            cost.add_edge(src, node.name)
    for u, v in cost.edges:
        cost.edges[u, v]["bytes"] = cost.nodes[u]["output_bytes"]
    cost.graph.update(
        format=GRAPH_FORMAT,
        model=name or type(module).__name__,
        device=str(device),
        device_name=device_name(device),
        micro_batch_size=_micro_batch_size(module, args, kwargs, batch_dim),
        granularity=graph.granularity,
        frontend=graph.frontend if graph.granularity == "ops" else "children",
        refused=list(graph.refused),
        note=graph.note,
        outputs=list(graph.outputs),
        together=[list(group) for group in graph.together],
        warmup=warmup,
        repeats=repeats,
        parallel_capacity=capacity,
        op_time_scale=scale,
        cpu_cores=cpu_cores(),
        saved_counted=True,
    )
    if runtime_overhead:
        overhead.charge_runtime_overhead(cost, device)
    cost.graph["profile_s"] = time.perf_counter() - started
    return cost


#: a weight bigger than this (a vocabulary's embedding or head: 4 GB in a 400 B Llama) is timed a
#: slice at a time: its replay's copy of the weight and its gradient would hold twice the weight
PIECE_BYTES = 512 * 2**20

#: operations whose output features are slices of one weight: (the weight's argument, the dim
#: that a slice of it narrows the output by, the bias's argument or ``None``)
_SLICEABLE: dict[Any, tuple[int, int, int | None]] = {
    torch.ops.aten.embedding.default: (0, 1, None),
    torch.ops.aten.linear.default: (1, 0, 2),
    nn.functional.embedding: (1, 1, None),
    nn.functional.linear: (1, 0, 2),
}


def _time_once(call: RecordedCall, timer: Callable[[Callable[[], Any]], tuple[float, Any]]) -> tuple[float, float]:
    """Forward and backward seconds of one replay of ``call`` on fresh copies of its inputs."""
    if call.node.kind in ("placeholder", "get_attr"):
        return 0.0, 0.0
    fn, args, kwargs, scale = _one_piece(call)
    args, kwargs, leaves = _fresh_inputs(args, kwargs)
    with torch.enable_grad():
        forward, output = timer(lambda: fn(*args, **kwargs))
        outs = [t for t in iter_tensors(output) if t.requires_grad]
        wrt = leaves + (_parameters(call) if fn is call.fn else [])
        if not outs or not wrt:
            return forward * scale, 0.0
        grads = [torch.randn_like(t) for t in outs]
        backward, _ = timer(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))
    return forward * scale, backward * scale


def _one_piece(call: RecordedCall) -> tuple[Callable[..., Any], tuple, dict, float]:
    """What to replay for ``call``: where it reads a weight over :data:`PIECE_BYTES` through an
    operation whose outputs are slices of it (:data:`_SLICEABLE`, or an ``nn.Linear`` or
    ``nn.Embedding`` called as a module), that operation as a function with the weight (and a
    linear layer's bias) narrowed to one slice of at most that size, and how many such slices the
    weight holds, which scales the times of one; else the call as it is, scaled by 1."""
    fn, args, kwargs = call.fn, call.args, call.kwargs
    module = call.module
    if type(module) is nn.Linear and len(args) == 1 and not kwargs:
        fn, args = nn.functional.linear, (args[0], module.weight, module.bias)
    elif type(module) is nn.Embedding and module.max_norm is None and len(args) == 1 and not kwargs:
        fn, args = nn.functional.embedding, (args[0], module.weight)
        kwargs = {"padding_idx": module.padding_idx, "scale_grad_by_freq": module.scale_grad_by_freq,
                  "sparse": module.sparse}
    found = _SLICEABLE.get(fn)
    whole = call.fn, call.args, call.kwargs, 1.0
    if found is None or len(args) <= found[0]:
        return whole
    position, dim, bias = found
    weight = args[position]
    if not isinstance(weight, torch.Tensor) or weight.dim() <= dim:
        return whole
    nbytes = weight.numel() * weight.element_size()
    size = weight.shape[dim] * PIECE_BYTES // nbytes if nbytes > PIECE_BYTES else 0
    if size < 1:
        return whole
    args, kwargs = list(args), dict(kwargs)
    args[position] = weight.narrow(dim, 0, size)
    if bias is not None:  # a bias has the output's features too
        if len(args) > bias and isinstance(args[bias], torch.Tensor):
            args[bias] = args[bias].narrow(0, 0, size)
        elif isinstance(kwargs.get("bias"), torch.Tensor):
            kwargs["bias"] = kwargs["bias"].narrow(0, 0, size)
    return fn, tuple(args), kwargs, weight.shape[dim] / size


def _fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Copies of the recorded inputs: leaves for gradients, cloned so in-place ops are safe."""
    leaves: list[torch.Tensor] = []

    def fresh(value: Any) -> Any:
        if value.requires_grad and value.is_floating_point():
            leaf = value.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return value.detach().clone()

    return map_tensors(fresh, args), map_tensors(fresh, kwargs), leaves


def _parameters(call: RecordedCall) -> list[torch.Tensor]:
    if call.module is None:
        return []
    return [p for p in call.module.parameters() if p.requires_grad]


def _owned_state(
    call: RecordedCall, owned: set[int]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Parameters and buffers first used by this node; a tensor shared by nodes counts once."""
    if call.module is not None:
        prefix = call.node.target + "."
        named_params = [(prefix + n, p) for n, p in call.module.named_parameters()]
        named_buffers = [(prefix + n, b) for n, b in call.module.named_buffers()]
    elif call.state:
        named_params = [(n, t) for n, t in call.state if isinstance(t, nn.Parameter)]
        named_buffers = [(n, t) for n, t in call.state if not isinstance(t, nn.Parameter)]
    else:
        return [], []
    params = [(n, p) for n, p in named_params if id(p) not in owned]
    buffers = [(n, b) for n, b in named_buffers if id(b) not in owned]
    owned.update(id(t) for _, t in params + buffers)
    return params, buffers


def _used_parameters(call: RecordedCall) -> list[torch.Tensor]:
    """Every parameter the node reads, owned or shared (tied) with an earlier node."""
    if call.module is not None:
        return list(call.module.parameters())
    return [t for _, t in call.state if isinstance(t, nn.Parameter)]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(value))


def _micro_batch_size(module: nn.Module, args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int]) -> int | None:
    """The example's samples, counted on ``batch_dim`` (``None`` where the tensors disagree)."""
    try:
        return batch_size_of(module, args, kwargs, batch_dim)
    except MicroBatchError:
        return None
