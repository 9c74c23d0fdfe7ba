"""From a model and one micro-batch to a plan: the one path the strategy and the CLI both take.

Capture, check that micro-batching keeps each sample's result, profile (or read the profile
cache), then partition over the devices with the same device defaults everywhere: links between
GPUs at 16 GB/s and 90% of each GPU's memory, free transfers and no memory limit between CPU
devices, unless told otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..batches import microbatch
from ..batches.batch_dependence import check_micro_batchable
from ..batches.batch_dims import batch_size_of, call_dims, first_micro_batch
from ..capture import OpGraph, UntraceableModelError, capture_call, children_instead
from ..capture.devices import on_module_device
from ..capture.isolation import keeps_random_state, planned_in_training
from ..capture.signature import original_forward
from ..cpu_allocator import keep_freed_memory
from ..device import is_accelerator, same_device
from ..device import memory_gb as device_memory_gb
from ..measure.cpu_threads import intra_op_threads, stage_threads
from ..plans.options import AUTO, PipelineOptions
from ..plans.plan import Plan
from ..weights.materialize import has_meta_state
from . import calibration
from .cache import default_cache_dir, usable_cache_dir
from .cost_graph import with_loss
from .optimizer_memory import UNKNOWN_OPTIMIZER_MULTIPLIER
from .optimizer_memory import optimizer_multiplier as multiplier_of
from .overhead import loss_seconds, optimizer_step_s
from .partition import InfeasiblePlanError, partition, plan_from_balance
from .profile_store import load_profile, profile_file, profile_key, store_profile
from .profiler import profile
from .rebalance import rebalanced

GPU_LINK_GBPS = 16.0
"""Bandwidth assumed between GPU stages when none is given: PCIe 4.0 x16 in one direction."""

INTERNODE_GPU_GBPS = 25.0
"""Bandwidth assumed from a GPU to another node's when none is given: one 200 Gb/s adapter each."""


@dataclass
class Planned:
    """A plan with the captured graph it cuts (``None`` for a profile loaded from a file), the cost
    graph it was made from, the cache file that cost graph was read from, if it was, and, from a
    layout search, the plans of the layouts predicted next fastest, to time against it."""

    plan: Plan
    graph: OpGraph | None
    cost: nx.DiGraph
    cached_from: Path | None = None
    alternatives: tuple[Plan, ...] = ()


def default_bandwidth_gbps(devices: Sequence[torch.device]) -> float | None:
    """Bandwidth between stages: :data:`GPU_LINK_GBPS` where a stage is on a GPU, else free."""
    return GPU_LINK_GBPS if any(is_accelerator(d) for d in devices) else None


def default_memory_gb(devices: Sequence[torch.device]) -> list[float | None]:
    """Memory per stage: 90% of each GPU's, unlimited on CPU."""
    return [device_memory_gb(d) for d in devices]




def chunk_candidates(batch_size: int, stages: int, even: bool = False) -> list[int]:
    """The counts ``chunks="auto"`` weighs: powers of two up to the batch size, and up to 8 per stage
    (at least 16), past which a step's overhead per micro-batch outweighs the bubble it saves; with
    ``even`` (stages in processes, as torch's schedules run them), only those that split the batch
    into micro-batches of one size and give every stage at least one."""
    limit = min(batch_size, max(16, 8 * stages))
    return [2**i for i in range(limit.bit_length())
            if 2**i <= limit and not (even and (batch_size % 2**i or 2**i < stages))]


def _in_training(fn: Callable[..., Planned]) -> Callable[..., Planned]:
    """``fn(module, ...)`` with ``module`` captured and profiled in training mode (see
    :func:`~lightning_antichain.capture.isolation.planned_in_training`)."""

    @functools.wraps(fn)
    def planned(module: nn.Module | None, *args: Any, **kwargs: Any) -> Planned:
        with planned_in_training(module) if module is not None else contextlib.nullcontext():
            return fn(module, *args, **kwargs)

    return planned


def _as_cpu_stages_run(fn: Callable[..., Planned]) -> Callable[..., Planned]:
    """``fn`` profiling and calibrating as the CPU stages among its devices will run: with their
    intra-op thread count (:mod:`~lightning_antichain.measure.cpu_threads`) and malloc keeping
    freed memory (:func:`~lightning_antichain.cpu_allocator.keep_freed_memory`)."""

    @functools.wraps(fn)
    def planned(module: nn.Module | None, args: tuple, kwargs: dict, devices: Sequence[str | torch.device],
                options: PipelineOptions | None = None, *, optimizers: Sequence[torch.optim.Optimizer] = (),
                name: str | None = None, cost: nx.DiGraph | None = None,
                loss: Callable[[Any], torch.Tensor | None] | None = None, **settings: Any) -> Planned:
        options = (options or PipelineOptions()).replace(**settings)
        threads = stage_threads(devices, options.cpu_threads)
        if threads is not None and options.share_cpu_allocator:
            keep_freed_memory()
        with intra_op_threads(threads):
            return fn(module, args, kwargs, devices, options, optimizers=optimizers, name=name, cost=cost, loss=loss)

    return planned


@keeps_random_state
@_in_training
@_as_cpu_stages_run
def plan_model(
    module: nn.Module | None,
    args: tuple,
    kwargs: dict,
    devices: Sequence[str | torch.device],
    options: PipelineOptions | None = None,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    name: str | None = None,
    cost: nx.DiGraph | None = None,
    loss: Callable[[Any], torch.Tensor | None] | None = None,
    **settings: Any,
) -> Planned:
    """Plan ``module`` over ``devices`` (one stage each) for micro-batches like ``args, kwargs``.

    The module is captured on the micro-batch and checked (``check_batch``, see
    :func:`~lightning_antichain.batches.batch_dependence.check_micro_batchable`); its profile is read from
    ``profile_cache`` (default ``~/.cache/lightning-antichain``) where a valid entry exists, else
    measured on ``devices[0]`` and stored. ``cost`` skips all that and plans a saved cost graph.
    ``balance`` fixes the operations per stage instead of planning. ``fallback="children"`` plans
    a model no frontend can capture at its top-level children (for a look at the plan only: such a
    plan cannot run). ``bandwidth_gbps`` and ``memory_gb`` default to
    :func:`default_bandwidth_gbps` and :func:`default_memory_gb`. ``optimizers`` are timed (on
    copies of their parameters) so that the predicted step includes their ``step()``. ``loss``
    (of the module's output, as stages as processes compute it on the last stage) is timed on each
    profile and charged to the output it reads (:func:`~.cost_graph.with_loss`).
    Plans are made for training: a module entirely in eval mode is planned as in training mode,
    and left in its mode. ``calibrate`` runs a plan whose stages share the CPU, or are all on GPUs, for a few
    steps and takes its stage times
    and parallel capacity from them (:mod:`~lightning_antichain.planner.calibration`; cached with the
    profiles), since per-op profiles mispredict CPU pipelines at small micro-batches.

    With ``chunks="auto"``, ``args, kwargs`` is a whole batch: each count of
    :func:`chunk_candidates` is profiled at its own micro-batch size and planned, and the plan with
    the shortest predicted step whose stages fit ``memory_gb`` (under ``recompute``) is returned,
    listing every candidate in ``plan.candidates``.
    """
    options = (options or PipelineOptions()).replace(**settings)
    devices = [torch.device(d) for d in devices]
    auto = options.chunks == AUTO
    if auto and (module is None or cost is not None):
        raise ValueError('chunks="auto" profiles the model at each candidate micro-batch size; give the '
                         "module and a whole batch, not a saved cost graph, or give chunks as a number")
    run = _ModelPlanning(module, devices, options, optimizers, loss)
    cached_from, key = None, ""
    if cost is None:
        if module is None:
            raise ValueError("plan_model needs a module to profile, or a cost graph (cost=)")
        size = batch_size_of(module, args, kwargs, options.batch_dim) if auto else None
        if auto and not size:
            raise ValueError('chunks="auto" needs a batch with samples on its batch dim (batch_dim=) to choose '
                             "how to split it; give chunks as a number instead")
        run.graph = captured_and_checked(module, args, kwargs, options)
        if size:
            return run.with_chunks_chosen(args, kwargs, size, name or type(module).__name__)
        cost, cached_from, key = run.profiled(args, kwargs, name)
    if optimizers:
        cost = cost.copy()
        cost.graph["optimizer_step_s"] = timed_optimizer_step_s(module, args, kwargs, optimizers, devices[0])
    plan = run.cut(cost, options.chunks)
    if key:  # profiled here, so there is a module to run
        assert module is not None
        plan = run.best_measured(plan, cost, key, *_repeated(module, args, kwargs, plan.chunks, options.batch_dim))
    return Planned(plan, run.graph, cost, cached_from)


def optimizer_multiplier_for(options: PipelineOptions, optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """Optimizer state per parameter byte: as given, else read from ``optimizers``."""
    if options.optimizer_multiplier is not None:
        return options.optimizer_multiplier
    return multiplier_of(optimizers) if optimizers else UNKNOWN_OPTIMIZER_MULTIPLIER


def profile_cache_dir(options: PipelineOptions) -> tuple[Path, bool]:
    """The directory of cached profiles, and whether to use it (not where it cannot be written)."""
    directory = Path(options.profile_cache) if options.profile_cache else default_cache_dir()
    if not options.use_profile_cache:
        return directory, False
    usable = usable_cache_dir(directory)
    return (usable, True) if usable is not None else (directory, False)


def captured_and_checked(module: nn.Module, args: tuple, kwargs: dict, options: PipelineOptions) -> OpGraph:
    """``module`` captured on the call ``args, kwargs``, and, with ``check_batch``, checked to keep
    each sample's result under micro-batching (not on meta: there are no values to check)."""
    graph = _capture(module, *_beside(module, args, kwargs), options.leaf_modules, options.batch_dim,
                     options.fallback, options.progress)
    if options.check_batch and graph.granularity == "ops" and not has_meta_state(module):
        check_micro_batchable(module, *_beside(module, args, kwargs), options.batch_dim)
    return graph


class _ModelPlanning:
    """One :func:`plan_model` call: cut a cost graph over ``devices``, profile (or read the
    cache), calibrate, and cut again on what calibration measured."""

    def __init__(self, module: nn.Module | None, devices: list[torch.device], options: PipelineOptions,
                 optimizers: Sequence[torch.optim.Optimizer],
                 loss: Callable[[Any], torch.Tensor | None] | None = None) -> None:
        self.module, self.devices, self.options, self.optimizers = module, devices, options, optimizers
        self.loss = loss
        self.multiplier = optimizer_multiplier_for(options, optimizers)
        self.directory, self.use_cache = profile_cache_dir(options)
        self.graph: OpGraph | None = None

    def cut(self, cost: nx.DiGraph, count: int) -> Plan:
        o = self.options
        return _cut(cost, self.devices, count, o.recompute, o.balance, o.method, o.bandwidth_gbps, o.memory_gb,
                    self.multiplier, o.schedule, o.accumulate_grad_batches)

    def profiled(self, args: tuple, kwargs: dict, label: str | None) -> tuple[nx.DiGraph, Path | None, str]:
        assert self.module is not None and self.graph is not None
        cost, cached_from, key = _profiled(self.module, self.graph, args, kwargs, self.devices[0],
                                           self.options.batch_dim, self.directory, self.use_cache,
                                           self.options.progress, label)
        timed = None if self.loss is None else loss_seconds(self.module, args, kwargs, self.loss)
        if timed is not None:  # the loss the last stage computes beyond the model
            cost = cost.copy()
            with_loss(cost, *timed)
        return cost, cached_from, key

    def measured(self, plan: Plan, key: str, args: tuple, kwargs: dict) -> Plan:
        """``plan`` calibrated on the batch ``args, kwargs``, where calibration applies."""
        options, graph = self.options, self.graph
        if not options.calibrate or not calibration.applies_to(plan, graph):
            return plan
        assert self.module is not None and graph is not None
        calibration_key = calibration.calibration_key(key, plan, options.recompute)
        found = calibration.load(self.directory, calibration_key, plan.num_stages) if self.use_cache else None
        read_from = calibration.calibration_file(self.directory, calibration_key) if found is not None else None
        if found is None:
            found = calibration.calibrate(self.module, graph, plan, args, kwargs, batch_dim=options.batch_dim,
                                          recompute=options.recompute, progress=options.progress,
                                          cpu_threads=options.cpu_threads)
            if self.use_cache:
                calibration.store(self.directory, calibration_key, found)
        return calibration.calibrated(plan, found, read_from)

    def best_measured(self, raw: Plan, cost: nx.DiGraph, key: str, args: tuple, kwargs: dict,
                      first: Plan | None = None) -> Plan:
        """``raw`` measured, then cut again on its measured stage times while that measures better
        (:mod:`.rebalance`); ``raw`` measured alone where there is nothing to measure or to move."""
        options = self.options
        if options.balance is not None or not options.rebalance_rounds or not options.calibrate or (
                not calibration.applies_to(raw, self.graph)):
            return first if first is not None else self.measured(raw, key, args, kwargs)
        return rebalanced(raw, cost, lambda scaled: self.cut(scaled, raw.chunks),
                          lambda p: self.measured(p, key, args, kwargs), rounds=options.rebalance_rounds, first=first)

    def with_chunks_chosen(self, args: tuple, kwargs: dict, size: int, name: str) -> Planned:
        """``chunks="auto"``: the plan of the micro-batch count predicted fastest on the whole batch
        ``args, kwargs`` of ``size`` samples, measured."""
        module = self.module
        assert module is not None
        optimizer_s = timed_optimizer_step_s(module, args, kwargs, self.optimizers, self.devices[0])
        chosen, cost, cached_from, key = _choose_chunks(
            module, args, kwargs, self.options.batch_dim, size, len(self.devices), name, optimizer_s,
            self.options.even_chunks, self.profiled,
            lambda cost, count, key: self.measured(self.cut(cost, count), key, args, kwargs))
        plan = self.best_measured(self.cut(cost, chosen.chunks), cost, key, args, kwargs, first=chosen)
        plan = replace(plan, candidates=chosen.candidates, batch_size=chosen.batch_size)
        return Planned(plan, self.graph, cost, cached_from)


def timed_optimizer_step_s(module: nn.Module | None, args: tuple, kwargs: dict,
                           optimizers: Sequence[torch.optim.Optimizer], device: torch.device | None = None) -> float:
    """Seconds of one step of ``optimizers``, timed on the gradients of one backward of ``module``
    on ``args, kwargs``: on CPU an optimizer's speed depends on its gradients' values (Adam took
    1.7x as long on ResNet-18's real gradients, most of them exactly zero, as on random ones)."""
    if module is None:
        return optimizer_step_s(list(optimizers))
    if not _runs_on(module, device):  # no backward to take there: random gradients on the profiling device
        return optimizer_step_s(list(optimizers), device=device)
    with calibration.untouched(module):
        calibration.backward_from(original_forward(module)(*args, **kwargs))
        return optimizer_step_s(list(optimizers))


def _repeated(module: nn.Module, args: tuple, kwargs: dict, times: int, batch_dim: int | Mapping[str, int]) -> tuple:
    """A batch of ``times`` copies of the micro-batch ``args, kwargs``, as ``(args, kwargs)``."""
    args, kwargs, dims = call_dims(module, args, kwargs, batch_dim)
    return microbatch.map_batched((args, kwargs), dims, lambda t, d: torch.cat([t] * times, d))


def _profiled(module: nn.Module, graph: OpGraph, args: tuple, kwargs: dict, device: torch.device,
              batch_dim: int | Mapping[str, int], directory: Path, use_profile_cache: bool,
              progress: bool, name: str | None) -> tuple[nx.DiGraph, Path | None, str]:
    """The cost graph of ``graph`` on one micro-batch (from the cache if it has it, else profiled and
    stored in ``directory``), the cache file it came from, and its cache key."""
    key = profile_key(graph, module, (args, kwargs), device)
    cost = load_profile(directory, key, graph) if use_profile_cache else None
    if cost is not None:
        return cost, profile_file(directory, key), key
    example: Any = kwargs if kwargs else args
    cost = profile(module, example, device, op_graph=graph, name=name or type(module).__name__,
                   batch_dim=batch_dim, progress=progress)
    if use_profile_cache:
        store_profile(directory, key, cost)
    return cost, None, key


def _cut(cost: nx.DiGraph, devices: list[torch.device], chunks: int, recompute: str,
         balance: Sequence[int] | None, method: str, bandwidth_gbps: float | None,
         memory_gb: float | Sequence[float | None] | None, optimizer_multiplier: float,
         schedule: str = "gpipe", accumulate_grad_batches: int = 1) -> Plan:
    names = [str(d) for d in devices]
    bandwidth = bandwidth_gbps if bandwidth_gbps is not None else default_bandwidth_gbps(devices)
    memory = memory_gb if memory_gb is not None else default_memory_gb(devices)
    if balance is not None:  # the budgets are recorded for the run-time check, not enforced
        return plan_from_balance(cost, list(balance), chunks=chunks, devices=names, bandwidth_gbps=bandwidth,
                                 optimizer_multiplier=optimizer_multiplier, recompute=recompute, memory_gb=memory,
                                 schedule=schedule, accumulate_grad_batches=accumulate_grad_batches)
    return partition(cost, len(devices), chunks=chunks, method=method, devices=names, bandwidth_gbps=bandwidth,
                     memory_gb=memory, optimizer_multiplier=optimizer_multiplier, recompute=recompute,
                     schedule=schedule, accumulate_grad_batches=accumulate_grad_batches)


def _choose_chunks(
    module: nn.Module, args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int], size: int, stages: int,
    name: str, optimizer_s: float, even: bool,
    profiled: Callable[[tuple, dict, str], tuple[nx.DiGraph, Path | None, str]],
    cut: Callable[[nx.DiGraph, int, str], Plan],
) -> tuple[Plan, nx.DiGraph, Path | None, str]:
    """The plan of the candidate count with the shortest predicted step that fits, listing every
    candidate, with its cost graph, the cache file that was read from, and its profile key."""
    costs: dict[int, tuple[nx.DiGraph, Path | None, str] | Exception] = {}
    rows: list[dict[str, Any]] = []
    best: tuple[Plan, nx.DiGraph, Path | None, str] | None = None
    refusal: InfeasiblePlanError | None = None
    for chunks in chunk_candidates(size, stages, even):
        micro = -(-size // chunks)
        if micro not in costs:
            try:
                costs[micro] = profiled(*first_micro_batch(module, args, kwargs, chunks, batch_dim),
                                        f"{name}, micro-batch {micro}")
            except (RuntimeError, ValueError) as exc:
                if not rows:  # the whole batch itself fails: nothing to weigh
                    raise
                costs[micro] = exc  # e.g. BatchNorm refuses a single sample in training
        row: dict[str, Any] = {"chunks": chunks, "micro_batch_size": micro, "predicted_step_s": None,
                               "peak_memory_bytes": None, "fits": False}
        rows.append(row)
        if isinstance(costs[micro], Exception):
            row["fails"] = str(costs[micro]).split("\n")[0]
            continue
        cost, cached_from, key = costs[micro]
        cost = cost.copy()
        cost.graph.update(optimizer_step_s=optimizer_s, model=name)
        try:
            plan = cut(cost, chunks, key)
        except InfeasiblePlanError as exc:
            refusal = refusal or exc
            continue
        row.update(predicted_step_s=plan.predicted_step_s, peak_memory_bytes=max(s.memory_bytes for s in plan.stages),
                   fits=True)
        if best is None or plan.predicted_step_s < best[0].predicted_step_s:
            best = (plan, cost, cached_from, key)
    if best is None:
        assert refusal is not None
        raise InfeasiblePlanError(f"no micro-batch count from 1 to {rows[-1]['chunks']} fits: {refusal}")
    plan, cost, cached_from, key = best
    return replace(plan, candidates=rows, batch_size=size), cost, cached_from, key


def _runs_on(module: nn.Module, device: torch.device | None) -> bool:
    """Whether all of ``module`` is real on ``device`` (or, with no device named, real at all)."""
    state = [*module.parameters(), *module.buffers()]
    if device is None:
        return not any(t.is_meta for t in state)
    return all(same_device(t.device, device) for t in state)


def _beside(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call moved to the device of a real module that waits on one device for its stages (the
    CPU, while the batch is on a GPU already): capture and the batch check run it there."""
    if has_meta_state(module):
        return args, kwargs
    return on_module_device(module, (args, kwargs))


def _capture(module: nn.Module, args: tuple, kwargs: dict, leaf_modules: Sequence[type | str],
             batch_dim: int | Mapping[str, int], fallback: str | None, progress: bool) -> OpGraph:
    try:
        return capture_call(module, args, kwargs, leaf_modules=leaf_modules, progress=progress, batch_dim=batch_dim)
    except UntraceableModelError as exc:
        if fallback != "children":
            raise
        return children_instead(module, kwargs if kwargs else args, exc)
