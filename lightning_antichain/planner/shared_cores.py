"""What CPU processes on one machine get through at once, measured by the ranks themselves before
rank 0 weighs layouts of them: the model's forward and backward, and the optimizer's step.

Stages as processes share the machine's cores and memory bandwidth, but neither an interpreter lock
nor a copy of the weights, so what two threads of the planning process show
(:func:`~lightning_antichain.planner.contention.parallel_capacity`) does not carry over. Where every
rank is there to take part, as before the first step of a layout search, each runs the step alone
and all at once (:func:`~lightning_antichain.planner.contention.processes_timing`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capture.signature import original_forward
from ..plans.layout import Layout
from . import calibration
from .contention import copied_training_step, processes_timing
from .optimizer_copies import optimizer_copies

OPTIMIZER_ROUNDS = 5
"""Rounds of the optimizers' probe (the model's: :func:`processes_timing`'s default)."""

DTENSOR_PROBE_TENSORS = 32
DTENSOR_PROBE_NUMEL = 256
DTENSOR_PROBE_STEPS = 5
"""The DTensor probe (:func:`dtensor_overhead_s`): small tensors, where DTensor's dispatch is all
the step's cost beyond the plain one."""


@dataclass(frozen=True)
class SharedCores:
    """What the ranks, CPU processes on one machine, get through at once in units of one rank
    alone (:func:`processes_timing`): running the model's forward and backward, and stepping the
    optimizer (memory-bound, it often shares the cores worse); ``None``: not measured. The
    ``_alone_s`` fields: the seconds each took one rank alone, the machine's speed at the time."""

    model: float | None
    optimizer: float | None = None
    model_alone_s: float | None = None
    optimizer_alone_s: float | None = None
    #: what FSDP2 adds to the optimizer's step per parameter tensor (:func:`dtensor_overhead_s`)
    optimizer_tensor_s: float | None = None
    #: the optimizer's sharing with each rank stepping ``1/share`` of the parameters, by share
    #: (the whole, share 1, is :attr:`optimizer`)
    optimizer_shares: tuple[tuple[int, float], ...] = ()
    #: whether the model's step was timed from the loss of its output (``model_alone_s`` counts it)
    with_loss: bool = False

    def optimizer_at(self, share: int) -> float | None:
        """How the optimizer's steps share the cores where each rank steps ``1/share`` of the
        parameters: as measured for the nearest share measured. Memory-bound, it shares them
        better on less: four ranks stepping the wide MLP's AdamW got 1.12-1.25 on the whole model
        each, 1.47-1.61 on half, 1.63-2.00 on a quarter (commit e1f2eec's message)."""
        measured = dict(self.optimizer_shares)
        if self.optimizer is not None:
            measured.setdefault(1, self.optimizer)
        if not measured:
            return None
        return measured[min(measured, key=lambda s: (abs(math.log(s / share)), s))]


def shared_cores(module: nn.Module, args: tuple, kwargs: dict, optimizers: Sequence[torch.optim.Optimizer],
                 group: Any = None, shares: Sequence[int] = (),
                 loss: Callable[[Any], torch.Tensor | None] | None = None) -> SharedCores | None:
    """What the ranks of ``group`` get through at once (:func:`processes_timing`), each running
    ``module``'s forward and backward on its call ``args, kwargs`` (its share of a batch), and
    each stepping copies of ``optimizers`` on the gradients of that call's backward, as planning
    times the optimizer alone (:func:`~lightning_antichain.planner.planning.timed_optimizer_step_s`:
    on a CPU the gradients' values set an optimizer's pace, and how it shares the cores: a wide
    MLP's AdamW measured 1.7-2.0 on random gradients, 1.0 on its own, as its steps in training
    showed); ``None`` for a module without values (on meta). ``shares``: also each rank
    stepping only ``1/share`` of the parameters, for each share beyond the whole (a layout's:
    :func:`share_of`). ``loss``: the model's step from that loss of its output, the work a search
    given the loss counts (``plan_layouts(loss=...)``). Every rank calls it; the module, its
    buffers and the optimizers stay as they were."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return None
    model = processes_timing(copied_training_step(module, args, kwargs, loss), group)
    counts = sorted({1, *(s for s in shares if s > 1)})
    with calibration.untouched(module):  # the copies step on real gradients: values set an optimizer's pace
        calibration.backward_from(original_forward(module)(*args, **kwargs))
        copies = {share: [fresh for fresh, _ in optimizer_copies(list(optimizers), share=share)] for share in counts}

    def stepping(fresh_ones: list[torch.optim.Optimizer]) -> Callable[[], None]:
        def step() -> None:
            for fresh in fresh_ones:
                fresh.step()
        return step

    # memory-bound, the steps share the cores better while the ranks drift apart, which more rounds
    # find: with the quickest round together, a wide MLP's AdamW read 1.64-1.77 over 9 rounds,
    # where training (its ranks in step after DDP's reduction) got about 1.15; over 5, 1.09-1.35
    timed = {share: processes_timing(stepping(fresh), group, OPTIMIZER_ROUNDS) if fresh else None
             for share, fresh in copies.items()}
    optimizer = timed[1]
    return SharedCores(None if model is None else model.capacity, None if optimizer is None else optimizer.capacity,
                       None if model is None else model.alone_s, None if optimizer is None else optimizer.alone_s,
                       dtensor_overhead_s(optimizers[0], group) if optimizers else None,
                       tuple((share, t.capacity) for share, t in timed.items() if share > 1 and t is not None),
                       loss is not None)


def share_of(layout: Layout, replication: str) -> int:
    """How many parts of the model's parameters each rank of ``layout`` steps one of: a pipeline
    position's (``pp``), and of it, with FSDP2, its shard (``pp * dp``)."""
    return layout.pp * (layout.dp if replication == "fsdp" else 1)


def dtensor_overhead_s(optimizer: torch.optim.Optimizer, group: Any = None) -> float | None:
    """What one parameter tensor adds to a step of ``optimizer``'s kind when it is a DTensor, as
    FSDP2 shards it, over the same step on plain tensors: every operation of the step goes through
    DTensor's dispatch (GPT's 99 tensors, AdamW: 7.0 ms on whole plain tensors, 19.2 on quarter
    shards). Timed on rank 0 alone on small shards, where the dispatch is all there is; every rank
    of ``group`` calls it and gets rank 0's value; ``None`` where the optimizer cannot be rebuilt
    or step DTensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    hyper = {k: v for k, v in inner.param_groups[0].items() if k != "params"} if inner.param_groups else {}
    seconds = torch.full((1,), -1.0, dtype=torch.float64)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        locals_ = [torch.randn(DTENSOR_PROBE_NUMEL) for _ in range(DTENSOR_PROBE_TENSORS)]
        grads = [torch.randn(DTENSOR_PROBE_NUMEL) for _ in range(DTENSOR_PROBE_TENSORS)]

        def step_s(as_dtensor: bool) -> float | None:
            wrap = (lambda t: DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False)) if as_dtensor \
                else torch.Tensor.clone
            params = [nn.Parameter(wrap(t)) for t in locals_]
            for param, grad in zip(params, grads):
                param.grad = wrap(grad)
            try:
                stepping = type(inner)([{**hyper, "params": params}])
                times = []
                for _ in range(DTENSOR_PROBE_STEPS + 1):
                    started = time.perf_counter()
                    stepping.step()
                    times.append(time.perf_counter() - started)
            except Exception:  # noqa: BLE001 - an optimizer with its own constructor, or none for DTensors:
                return None    # not measured, and the other ranks still get rank 0's answer
            return statistics.median(times[1:])

        plain, sharded = step_s(False), step_s(True)
        if plain is not None and sharded is not None:
            seconds[0] = max(0.0, sharded - plain) / DTENSOR_PROBE_TENSORS
    dist.broadcast(seconds, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return None if float(seconds[0]) < 0 else float(seconds[0])
