"""How much work CPU stages get through when they run at once, in units of one stage alone.

Stages on CPU devices share one machine's cores, memory bandwidth and interpreter lock, so two
stages running at once do less than twice the work of one: small micro-batches contend for the
interpreter lock, large ones for memory bandwidth. The profiler measures this once per model and
micro-batch size (the whole model's forward and backward on two threads at once against one);
calibration reads it again from the tasks of real pipelined steps (:func:`runtime_capacity`). The
planner's prediction of a step uses it.

Stages as processes share the cores but not an interpreter lock, and each holds its own copy of
the weights: two threads tell little of them (MobileNetV3's small micro-batches: 1.35-2.0 on
threads, run to run; a wide MLP: 1.9 on threads, 1.2 as processes whose weights no longer share a
cache). Where the ranks are there to ask, they measure it themselves (:func:`processes_capacity`,
:mod:`~lightning_antichain.planner.shared_cores`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from ..capture.isolation import own_forward
from ..capture.pytrees import iter_tensors
from ..cpu_allocator import keep_freed_memory
from ..in_process.worker import WorkerPool
from ..measure.cpu_threads import cpu_cores
from ..plans.schedule import Task, Timed


class PairedSteps:
    """Two threads running ``steps`` (one each, on their own copies of the inputs) at once, against
    one thread alone, a round at a time: a caller spreads the rounds over a longer measurement (the
    profile's rounds over every operation), so that a slow spell of a shared machine touches a few
    rounds, not all (MobileNetV3's whole step read 52 ms where it ran in 37, from three rounds back
    to back). Use it as a context manager: its worker threads end with it."""

    def __init__(self, steps: list[Callable[[], None]]) -> None:
        keep_freed_memory()  # as CPU pipelines do, so the threads contend as theirs will
        threads = torch.get_num_threads()  # the stages' count, which planning profiles with
        self.steps = steps
        self._alone_pool = WorkerPool(1, name="antichain-alone", threads=threads)
        self._pair_pool = WorkerPool(2, name="antichain-pair", threads=threads)
        self._alone: list[float] = []
        self._together: list[float] = []
        self._paired = True
        self._warm = False

    def __enter__(self) -> PairedSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self._alone_pool.shutdown()
        self._pair_pool.shutdown()

    def round(self) -> None:
        """One step alone, then (while the model trains on two threads at all) two at once; the
        first round only warms up."""
        start = time.perf_counter()
        self._alone_pool.run(self.steps[:1], lambda: None)
        alone = time.perf_counter() - start
        together = None
        if self._paired:
            start = time.perf_counter()
            try:
                self._pair_pool.run(self.steps, lambda: None)
                together = time.perf_counter() - start
            except RuntimeError:  # e.g. autograd's in-place check tripped by the other thread
                self._paired = False
        if self._warm:
            self._alone.append(alone)
            if together is not None:
                self._together.append(together)
        self._warm = True

    def result(self) -> tuple[float | None, float]:
        """The work two threads at once get through in units of one alone (2.0: no contention;
        ``None`` where the model cannot train on two threads at once, which calibration measures
        then), and the seconds one step takes alone: medians of the rounds after the first."""
        while not self._alone:  # a warm-up round and a timed one at least
            self.round()
        alone, quickest = statistics.median(self._alone), min(self._alone)
        if not self._paired or not self._together:
            return None, quickest
        return min(2.0, 2.0 * alone / statistics.median(self._together)), quickest


MIN_TIMED_S = 0.05
"""The shortest time the capacity probe times: a shorter step is run several times in a row."""


@dataclass(frozen=True)
class SharedTiming:
    """What :func:`processes_timing` measured: the work the ranks get through at once in units of
    one alone, and the seconds one ``step`` took rank 0 alone (the machine's speed at the time)."""

    capacity: float
    alone_s: float


def processes_capacity(step: Callable[[], None], group: Any = None, repeats: int = 9) -> float | None:
    """The ``capacity`` of :func:`processes_timing`."""
    timing = processes_timing(step, group, repeats)
    return None if timing is None else timing.capacity


def processes_timing(step: Callable[[], None], group: Any = None, repeats: int = 9) -> SharedTiming | None:
    """Work done by every rank of ``group`` running ``step`` at once, in units of one rank alone
    (the number of ranks: no contention). Every rank calls it, with its own ``step``, and gets the
    same value: over ``repeats`` rounds, rank 0's quickest time alone against the slowest rank's
    median time together; ``None`` where ``step`` failed on any rank (nothing is measured then, and no
    rank waits for another)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        started = time.perf_counter()
        step()  # to warm up
        ran = 1.0
    except (RuntimeError, ValueError):  # e.g. BatchNorm refuses a single sample in training
        ran = 0.0
    warm = torch.tensor([-ran, time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
    if float(warm[0]) > -1.0:  # some rank failed
        return None
    times_each = max(1, math.ceil(MIN_TIMED_S / max(float(warm[1]), 1e-6)))  # a short step, timed several times

    def steps() -> float:
        started = time.perf_counter()
        for _ in range(times_each):
            step()
        return time.perf_counter() - started

    rounds = []
    for _ in range(repeats):
        times = torch.zeros(2, dtype=torch.float64)  # rank 0 alone, the slowest rank together
        dist.barrier(group=group)
        if rank == 0:
            times[0] = steps()
        dist.barrier(group=group)
        times[1] = steps()
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        rounds.append((float(times[0]), float(times[1])))
    # alone: the quickest, the least disturbed, as the profile times each operation; together: the
    # typical round, as training's steps run (the quickest of them read MobileNetV3 at 1.70-1.76
    # where its ranks in lockstep got 1.43-1.49, the median 1.41-1.50; the decoder's alike)
    alone, together = min(t[0] for t in rounds), statistics.median(t[1] for t in rounds)
    capacity = min(float(min(ranks, cpu_cores())), max(1.0, ranks * alone / together))
    return SharedTiming(capacity, alone / times_each)


def capacity_of_two(capacity: float, ranks: int, cores: int) -> float:
    """The ``parallel_capacity`` (two stages at once, in units of one) that gives ``capacity``
    for ``ranks`` at once on ``cores`` cores (:meth:`~lightning_antichain.plans.plan.Plan.capacity`
    adds the same for each stage while there are cores)."""
    sharing = min(ranks, cores) - 1
    return 1.0 if sharing < 1 else min(2.0, 1.0 + (capacity - 1.0) / sharing)


def training_step(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[], None]:
    """One forward and backward of ``module``, with gradients returned rather than accumulated (so
    two threads may run it at once)."""
    return _gradients_of(module, lambda: module(*args, **kwargs))


def copied_training_step(module: nn.Module, args: tuple, kwargs: dict,
                         loss: Callable[[Any], torch.Tensor | None] | None = None) -> Callable[[], None]:
    """:func:`training_step` of ``module`` on copies of its buffers (a BatchNorm's running
    statistics stay as they were), sharing its parameters, whose values it does not change;
    with ``loss``, from that loss of its output."""
    state = copied_buffers(module)

    def forward() -> Any:
        with own_forward(module):  # the loss may call the forward a strategy installed
            output = functional_call(module, state, args, kwargs)
        return output if loss is None else loss(output)

    return _gradients_of(module, forward)


def copied_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state for :func:`torch.func.functional_call` with its buffers copied: a call
    in training mode then leaves its running statistics as they were."""
    return {**dict(module.named_parameters()), **{n: b.clone() for n, b in module.named_buffers()}}


def _gradients_of(module: nn.Module, forward: Callable[[], Any]) -> Callable[[], None]:
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        with torch.enable_grad():
            outs = [t for t in iter_tensors(forward()) if t.requires_grad]
            if outs and params:
                torch.autograd.grad(outs, params, [torch.ones_like(t) for t in outs], allow_unused=True)

    return step


def runtime_capacity(timed: Sequence[Sequence[Timed]], work: Mapping[Task, float], shared: Sequence[bool],
                     cores: int) -> float | None:
    """The ``parallel_capacity`` that explains a measured step: ``work[task]`` is what each task
    took alone, ``timed`` when it ran. With ``T_n`` the time ``n`` shared stages were busy at once,
    the model (:meth:`~lightning_antichain.plans.plan.Plan.capacity`) gets through
    ``T_n * (1 + extra * (min(n, cores) - 1))`` of work in it, so ``extra`` is the work beyond
    ``sum(T_n)`` over ``sum(T_n * (min(n, cores) - 1))``.
    ``None`` where shared stages overlapped too little (under 1% of their busy time) to tell."""
    edges: list[tuple[float, int]] = []
    total = 0.0
    for k, tasks in enumerate(timed):
        if not shared[k]:
            continue
        for t in tasks:
            edges += [(t.start, 1), (t.end, -1)]
            total += work[t.task]
    edges.sort()
    busy, weighted, running, last = 0.0, 0.0, 0, 0.0
    for at, change in edges:
        if running:
            busy += at - last
            weighted += (at - last) * (min(running, cores) - 1)
        running += change
        last = at
    if weighted <= 0.01 * busy:
        return None
    return min(2.0, max(0.5, 1.0 + (total - busy) / weighted))
