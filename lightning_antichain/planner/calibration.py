"""What a plan's stages take in the runtime itself, measured on a few of its steps.

Per-op profiles and the profiler's two-thread probe predict CPU pipelines well at large
micro-batches and badly at small ones. At 4 samples per micro-batch (ResNet-18), ops replayed one
at a time added up to 26% more than the runtime's tasks took, and two whole models on two threads
slowed each other far more than two stages of one pipeline do (docs/benchmark-runs.md, "How much CPU
stages slow each other"). On a GPU, ops replayed one at a time, each synchronised, added up to
1.3x to 2.75x the step (docs/benchmark-runs.md, "On a GPU"): a step's kernels run while the host
launches the next ones. So a plan whose stages share the CPU, or whose stages are all on
accelerators, is run for a few steps before it is trusted: its micro-batches one at a time (what
each stage's forward and backward take alone; on a GPU, the time between marks on the stage's
compute stream) and pipelined (how much CPU stages slow each other while they overlap). The
plan's stage times and parallel capacity become the runtime's own. One micro-batch of each step
also has its operations timed inside their stages (:mod:`~lightning_antichain.measure.op_clock`),
which the planner's loop (:mod:`.rebalance`) cuts again on. Results are cached next to the
profiles, and the module is left as it was found: parameters, gradients, buffers, attributes and
random state.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..batches import microbatch
from ..batches.batch_dims import call_dims
from ..capture.isolation import attributes_restored, side_effects_undone
from ..capture.opgraph import OpGraph
from ..capture.pytrees import iter_tensors
from ..device import is_accelerator, shares_host, synchronize
from ..measure.op_clock import OpClock
from ..plans.plan import Plan
from ..plans.schedule import Task, Timed, runs_in_process
from ..plans.step_prediction import recomputed_micro_batches
from ..torch_private import tree_map_only
from ..weights.materialize import has_meta_state
from .cache import DamagedEntry, entry_key, entry_path, read_entry, write_entry
from .contention import runtime_capacity
from .prediction_check import span_s
from .progress import Progress


@dataclass(frozen=True)
class Calibration:
    """Per stage, the seconds one micro-batch's forward and backward task take in the runtime when
    nothing else runs; the work two CPU stages get through at once in units of one alone, read from
    the overlap of the pipelined steps (``None`` where they never overlapped); the median
    pipelined step measured (forward and backward, no optimizer); and the median span of its tasks
    (:func:`~lightning_antichain.planner.prediction_check.span_s`), which training steps are checked against."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    parallel_capacity: float | None
    pipelined_step_s: float
    pipelined_span_s: float
    steps: int
    #: per operation, the seconds its forward and backward took inside its stage's passes (median
    #: over the steps; :mod:`~lightning_antichain.measure.op_clock`), which the planner folds into
    #: its costs; empty where they were not timed
    operations: dict[str, tuple[float, float]] = field(default_factory=dict)


def applies_to(plan: Plan, graph: OpGraph | None) -> bool:
    """Whether calibration can help ``plan``: two or more stages sharing the CPU, or stages all on
    accelerators (where a step's kernels overlap its launches, which operations timed one at a time
    do not show), and a graph to run of a model that is real (calibrating one built on meta would
    make all of it real at once)."""
    cpu_stages = sum(shares_host(s.device) for s in plan.stages)
    on_accelerators = all(is_accelerator(s.device) for s in plan.stages)
    return (graph is not None and graph.granularity == "ops" and not has_meta_state(graph.module)
            and runs_in_process(plan.schedule)
            and ((cpu_stages >= 2 and cpu_stages == plan.num_stages) or on_accelerators))


def calibrate(
    module: nn.Module,
    graph: OpGraph,
    plan: Plan,
    args: tuple,
    kwargs: dict,
    *,
    batch_dim: int | Mapping[str, int] = 0,
    recompute: str = "never",
    steps: int = 3,
    max_steps: int = 15,
    seconds: float = 6.0,
    progress: bool = True,
    cpu_threads: int | None = None,
) -> Calibration:
    """Run ``plan`` on the batch ``args, kwargs`` (``plan.chunks`` micro-batches), pipelined and one
    micro-batch at a time in turn, and read its tasks' times: one round to warm up, then as many as
    fill ``seconds`` (at least ``steps``, at most ``max_steps``), so that a passing slowdown of a
    shared machine is outvoted by the median. On accelerators the pipelined step is then timed
    again, as many steps back to back as training runs them. ``cpu_threads``: the stages' intra-op threads, as
    the Pipeline option."""
    from ..in_process.pipeline import Pipeline

    call_args, call_kwargs, dims = call_dims(module, args, kwargs, batch_dim)
    options: dict[str, Any] = {"graph": graph, "batch_dim": batch_dim, "check_batch": False,
                               "cpu_threads": cpu_threads}
    if is_accelerator(plan.stages[0].device):
        # the strategy hands the runtime batches on its root device, the first stage's, and takes the
        # output there: timed with the batch in host memory, a step would also copy it in and the
        # output out, and backward from an output in host memory
        root = torch.device(plan.stages[0].device)
        call_args, call_kwargs = tree_map_only(torch.Tensor, lambda t: t.to(root), (call_args, call_kwargs))
        options["output_device"] = root
    micro_batches = microbatch.scatter((call_args, call_kwargs), plan.chunks, dims)
    count = len(micro_batches)
    recomputed = recomputed_micro_batches(recompute, count)
    shared = [shares_host(s.device) for s in plan.stages]
    devices = [s.device for s in plan.stages]
    rounds: list[Round] = []
    operations: list[dict[str, tuple[float, float]]] = []
    with untouched(module), Pipeline(module, plan, chunks=plan.chunks, recompute=recompute, **options) as piped, \
            Pipeline(module, plan, chunks=1, **options) as single:

        def pipelined_step() -> tuple[float, list[list[Timed]]]:
            module.zero_grad(set_to_none=True)  # as a training step begins: its first backwards add into nothing
            synchronize(devices)
            started = time.perf_counter()
            backward_from(piped(*call_args, **call_kwargs))
            synchronize(devices)
            return time.perf_counter() - started, [list(stage) for stage in piped.last_step.timed]

        def one_round() -> Round:
            elapsed, timed = pipelined_step()
            alone = []
            for m, (micro_args, micro_kwargs) in enumerate(micro_batches):
                if m == 0 and single.stages:
                    operations.append(_clocked_pass(single, micro_args, micro_kwargs))
                    if count == 1:  # the clock slows what it times: take the stage times from a pass without it
                        alone.append(single.last_step.task_seconds())
                        backward_from(single(*micro_args, **micro_kwargs))
                else:
                    backward_from(single(*micro_args, **micro_kwargs))
                alone.append(single.last_step.task_seconds())
            return elapsed, alone, timed

        started = time.perf_counter()
        one_round()
        round_s = time.perf_counter() - started
        operations.clear()
        wanted = max(steps, min(max_steps, math.ceil(seconds / max(round_s, 1e-9))))
        on_accelerators = not any(shared)
        reporter = Progress(wanted * (2 if on_accelerators else 1), enabled=progress, unit="steps",
                            label=f"calibrating {plan.model or type(module).__name__} on {count} micro-batches")
        for _ in range(wanted):
            rounds.append(one_round())
            reporter.step()
        if on_accelerators:
            rounds = _with_steps_back_to_back(rounds, pipelined_step, wanted, reporter)
    reporter.close()
    return _summary(rounds, operations, plan, recomputed, shared)


def _with_steps_back_to_back(rounds: list[Round], pipelined_step: Callable[[], tuple[float, list[list[Timed]]]],
                             wanted: int, reporter: Progress) -> list[Round]:
    """``rounds`` with their pipelined steps replaced by as many run back to back, as training runs
    them, once they stopped getting quicker. Where the host's launches set the pace (accelerators,
    small micro-batches), a pipelined step run between micro-batches run alone took up to 1.28x a
    training step, and a training loop's steps kept getting quicker for its first 4 or 5 (ResNet-50
    in 8 micro-batches on an H200: commit 49c863b's message)."""
    best = math.inf
    for warmed in range(MAX_WARMUP_STEPS):
        elapsed, _ = pipelined_step()
        if warmed >= 2 and elapsed > SETTLED * best:
            break
        best = min(best, elapsed)
    steps = []
    for _ in range(wanted):
        steps.append(pipelined_step())
        reporter.step()
    return [(elapsed, alone, timed) for (elapsed, timed), (_, alone, _) in zip(steps, rounds)]


#: the most pipelined steps run before those timed back to back (:func:`_with_steps_back_to_back`)
MAX_WARMUP_STEPS = 10
#: a warm-up step no quicker than this times the quickest before it ends the warm-up
SETTLED = 0.97


Round = tuple[float, list[dict[Task, float]], list[list[Timed]]]


def _summary(rounds: list[Round], operations: list[dict[str, tuple[float, float]]], plan: Plan, recomputed: int,
             shared: list[bool]) -> Calibration:
    """The medians over ``rounds`` (each: the pipelined step's seconds, each micro-batch's task
    times run alone, the pipelined step's timed tasks) of what a plan takes from calibration."""
    forward, backward, capacities = [], [], []
    for _, alone, timed in rounds:
        unclocked = alone[1:] or alone  # the clock adds a little to the first micro-batch's times
        # .get: a stage is not bound to run a backward when nothing in it needs a gradient
        forward.append([statistics.fmean(a.get(Task("forward", k, 0), 0.0) for a in unclocked)
                        for k in range(plan.num_stages)])
        backward.append([statistics.fmean(a.get(Task("backward", k, 0), 0.0) for a in unclocked)
                         for k in range(plan.num_stages)])
        work = {}
        for m, a in enumerate(alone):
            for k in range(plan.num_stages):
                work[Task("forward", k, m)] = a.get(Task("forward", k, 0), 0.0)
                again = work[Task("forward", k, m)] if m < recomputed else 0.0
                work[Task("backward", k, m)] = a.get(Task("backward", k, 0), 0.0) + again
        capacity = runtime_capacity(timed, work, shared, plan.cpu_cores or plan.num_stages)
        if capacity is not None:
            capacities.append(capacity)
    return Calibration(
        forward_s=tuple(statistics.median(r[k] for r in forward) for k in range(plan.num_stages)),
        backward_s=tuple(statistics.median(r[k] for r in backward) for k in range(plan.num_stages)),
        parallel_capacity=statistics.median(capacities) if len(capacities) == len(rounds) else None,
        pipelined_step_s=statistics.median(r[0] for r in rounds),
        pipelined_span_s=statistics.median(span_s(r[2]) for r in rounds),
        steps=len(rounds),
        operations=_medians(operations),
    )


def _clocked_pass(single: Any, args: tuple, kwargs: dict) -> dict[str, tuple[float, float]]:
    """One forward and backward of the one-micro-batch pipeline ``single`` with its operations timed
    in context: per operation, its forward and backward seconds."""
    clocks = [OpClock(stage.device) for stage in single.stages]
    for stage, clock in zip(single.stages, clocks):
        stage.clock = clock
    try:
        backward_from(single(*args, **kwargs))
    finally:
        for stage in single.stages:
            stage.clock = None
    record = single.last_step
    for tasks in record.timed:
        for timed in tasks:
            if timed.task.phase == "backward":
                clocks[timed.task.stage].backward_ended(record.task_end(timed.task))
    return {name: (clock.forward_s.get(name, 0.0), clock.backward_s.get(name, 0.0))
            for clock in clocks for name in {*clock.forward_s, *clock.backward_s}}


def _medians(passes: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    names = {name for times in passes for name in times}
    return {name: (statistics.median(p.get(name, (0.0, 0.0))[0] for p in passes),
                   statistics.median(p.get(name, (0.0, 0.0))[1] for p in passes)) for name in sorted(names)}


def calibrated(plan: Plan, found: Calibration, read_from: Path | None = None) -> Plan:
    """``plan`` with each stage's times and the parallel capacity measured in the runtime, and its
    step predicted again from them (on accelerators, with the per-step cost that the measured
    pipelined step leaves unexplained); the profiled values, and the cache file the calibration was
    read from (``None``: measured now), are kept in ``plan.calibration``."""
    # the micro-batches run alone add their gradients into those of the runs before them
    stages = [
        replace(s, forward_s=max(0.0, f - plan.task_overhead_s - s.transfer_s / 2),
                backward_s=max(0.0, b - plan.task_overhead_s - s.transfer_s / 2 - plan.prediction.accumulation_s(s)))
        for s, f, b in zip(plan.stages, found.forward_s, found.backward_s)
    ]
    profiled = sum(s.compute_s for s in plan.stages)
    total = sum(s.compute_s for s in stages)
    capacity = plan.parallel_capacity if found.parallel_capacity is None else found.parallel_capacity
    new = replace(
        plan,
        stages=stages,
        bottleneck_s=max(s.time_s for s in stages),
        lower_bound_s=plan.lower_bound_s * (total / profiled if profiled > 0 else 1.0),
        total_compute_s=total,
        parallel_capacity=capacity,
        calibration={**asdict(found), "profiled_compute_s": [s.compute_s for s in plan.stages],
                     "profiled_bound_ratio": plan.bound_ratio,
                     "profiled_parallel_capacity": plan.parallel_capacity,
                     "read_from": None if read_from is None else str(read_from)},
    )
    if all(is_accelerator(s.device) for s in stages):
        new = _fitted_to_pipelined_step(new, found.pipelined_step_s)
    return replace(new, predicted_step_s=new.predict_step())


def _fitted_to_pipelined_step(plan: Plan, pipelined_s: float) -> Plan:
    """On accelerators, ``plan`` predicting the pipelined step it was measured to take. Where the
    stage times leave part of it unexplained, that part is the runtime's per-step cost (what its
    host work leaves the devices idle, not the host time measured on a tiny model, overhead.py).
    Where they explain more than it took, the micro-batches run one at a time were slower than in
    the pipelined steps: where the host's launches set the pace, a host that waits on the device
    after every micro-batch launches more slowly than one that launches ahead (over-predictions of
    1.11-1.27 on an H200, docs/benchmark-runs.md, "On a GPU"). The stage times are then scaled to
    the pipelined step, the state training runs in; their ratios, which the cut balances, stand."""
    def explained(p: Plan) -> float:
        # the pipelined steps timed start from empty gradients, as the window's first batch does
        return replace(p, step_overhead_s=0.0, optimizer_step_s=0.0, accumulate_grad_batches=1).predict_step()

    for _ in range(3):  # the step is not quite proportional to the stage times (transfers, task overheads)
        now = explained(plan)
        if now <= pipelined_s * 1.001 or now <= 0:
            break
        scale = pipelined_s / now
        stages = [replace(s, forward_s=s.forward_s * scale, backward_s=s.backward_s * scale) for s in plan.stages]
        plan = replace(plan, stages=stages, bottleneck_s=max(s.time_s for s in stages),
                       lower_bound_s=plan.lower_bound_s * scale, total_compute_s=plan.total_compute_s * scale)
    return replace(plan, step_overhead_s=max(0.0, pipelined_s - explained(plan)))


def calibration_key(profile_key: str, plan: Plan, recompute: str) -> str:
    """The cache key of a calibration: what it depends on beyond the profile is the cut, the devices,
    the micro-batch count, the recompute mode and the threads each stage has."""
    return entry_key("calibration", profile_key, plan.chunks, recompute, [s.nodes for s in plan.stages],
                     [s.device for s in plan.stages], torch.get_num_threads(), plan.cpu_cores)


def load(directory: Path, key: str, stages: int) -> Calibration | None:
    """The calibration cached under ``key``, if there is one and it is whole."""
    return read_entry(directory, "calibration", key, lambda data: _parsed(data, stages))


def _parsed(data: Any, stages: int) -> Calibration:
    found = Calibration(tuple(map(float, data["forward_s"])), tuple(map(float, data["backward_s"])),
                        None if data["parallel_capacity"] is None else float(data["parallel_capacity"]),
                        float(data["pipelined_step_s"]), float(data["pipelined_span_s"]), int(data["steps"]),
                        {str(k): (float(v[0]), float(v[1])) for k, v in data.get("operations", {}).items()})
    if not len(found.forward_s) == len(found.backward_s) == stages:
        raise DamagedEntry(f"it has times for {len(found.forward_s)} stages, not {stages}")
    if any(t < 0 for t in found.forward_s + found.backward_s):
        raise DamagedEntry("it has negative stage times")
    return found


def store(directory: Path, key: str, found: Calibration) -> None:
    write_entry(directory, "calibration", key, asdict(found))


def calibration_file(directory: Path, key: str) -> Path:
    return entry_path(directory, "calibration", key)


def backward_from(output: Any) -> None:
    """Backward from every floating output that needs a gradient, as a loss summing them would."""
    outs = [t for t in iter_tensors(output) if t.requires_grad and t.is_floating_point()]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


@contextlib.contextmanager
def untouched(module: nn.Module) -> Iterator[None]:
    """Gradients (``None`` inside the block), buffers, attributes and random state as they were
    before the block, and every parameter and buffer on the device it was on: calibrating on GPUs
    places the stages there, and a module left on the GPU would be captured again as another graph
    (Hugging Face code takes other paths on CUDA) than the one planned."""
    grads = [(p, p.grad) for p in module.parameters()]
    homes = [(t, t.device) for t in [*module.parameters(), *module.buffers()]]
    for p, _ in grads:
        p.grad = None
    try:
        with attributes_restored(module), side_effects_undone(module), torch.enable_grad():
            yield
    finally:
        with torch.no_grad():
            for tensor, device in homes:
                if tensor.device != device:
                    tensor.data = tensor.data.to(device)
        for p, grad in grads:
            p.grad = grad
