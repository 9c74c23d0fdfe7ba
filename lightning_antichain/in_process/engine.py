"""Run micro-batches through the stages of a plan, forward and backward, one worker thread per stage.

Forward: the batch is split into micro-batches; stage k's worker takes micro-batch m from stage
k-1 as soon as it is ready, so all stages work at once. Each worker runs its stage's tasks in the
order the :class:`~lightning_antichain.plans.schedule.Schedule` lists them (GPipe's fill-drain). Each stage
keeps the autograd graph of its own micro-batches, rooted at detached copies of its inputs.

Backward: the gathered output is produced by one autograd Function. When the caller's loss is
backpropagated, that Function's backward hands the output gradients to the last stage, and each
worker runs its stage's backward for micro-batches M-1 .. 0 and passes the input gradients
upstream. PyTorch runs a CPU backward on the thread that calls it, so driving it from the stage's
own worker is what lets the backward of different stages overlap.

Nothing is left behind: the workers (:mod:`lightning_antichain.in_process.worker`) are stopped after a failed or
interrupted pass, and a stage that raises stops the pass; its exception reaches the caller with the
stage and micro-batch named.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device import (
    CallerStreams,
    StageStreams,
    arrive,
    autocast_managers,
    autocast_settings,
    autograd_thread_device,
    caller_streams,
    clock_seconds,
    computing,
    forget_autocast_casts,
    release_to_caller,
    same_device,
    ship,
    start_clock,
    wait_for_caller,
)
from ..measure.saved_tensors import HeldMemory
from ..plans.schedule import Schedule, Task, Timed, gpipe
from ..stages.batchnorm import recomputing
from ..stages.randomness import drawing
from ..stages.split import StageModule
from .worker import WorkerPool


class PipelineStageError(RuntimeError):
    """A stage raised; used on Python < 3.11 where exceptions cannot carry notes."""


@dataclass
class _Failure:
    stage: int
    micro_batch: int
    phase: str
    error: BaseException


class _Abort:
    """Sentinel sent downstream when an upstream stage failed or the caller gave up."""


ABORT = _Abort()


@dataclass
class _Saved:
    """What a stage keeps of one micro-batch for its backward: its input leaves (gradient leaves
    where they need one), how they nest (``spec``), and its output leaves, or ``None`` when the
    micro-batch is recomputed."""

    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...] | None
    spec: Any = None
    counted: Any = None  # keeps ``inputs`` and ``outputs`` counted in the stage's HeldMemory


@dataclass
class StepRecord:
    """What the stages did in one training step: each stage's tasks, forward then backward, in the
    order it ran them, with when (seconds from the start of the forward pass)."""

    timed: list[list[Timed]]
    started_at: float = field(default_factory=time.perf_counter)
    #: per stage, each task's marks on its device's compute stream (GPU stages only)
    marks: list[list[tuple[Any, Any]]] = field(default_factory=list)

    @classmethod
    def for_stages(cls, count: int) -> StepRecord:
        return cls([[] for _ in range(count)], marks=[[] for _ in range(count)])

    def add(self, task: Task, started: float, marks: tuple[Any, Any] | None = None) -> None:
        """Note that ``task`` ran from ``started`` (a ``time.perf_counter()`` reading) until now, and
        on a GPU between the two ``marks`` (:func:`~lightning_antichain.device.start_clock`) on its compute stream."""
        self.timed[task.stage].append(Timed(task, started - self.started_at, time.perf_counter() - self.started_at))
        if marks is not None:
            self.marks[task.stage].append(marks)

    @property
    def ran(self) -> list[list[Task]]:
        """The tasks each stage ran, in the order it ran them."""
        return [[t.task for t in stage] for stage in self.timed]

    def task_seconds(self) -> dict[Task, float]:
        """Each task's seconds: on a GPU its time on the device between its marks (read from
        events, so this waits for them), elsewhere its wall time."""
        seconds = {}
        for stage, marks in zip(self.timed, self.marks):
            for i, timed in enumerate(stage):
                seconds[timed.task] = clock_seconds(*marks[i]) if marks else timed.end - timed.start
        return seconds

    def task_end(self, task: Task) -> Any:
        """When ``task`` ended on its device's clock: its end mark on a GPU, else the
        ``time.perf_counter()`` reading (:func:`~lightning_antichain.device.mark`)."""
        stage, marks = self.timed[task.stage], self.marks[task.stage]
        i = next(i for i, timed in enumerate(stage) if timed.task == task)
        return marks[i][1] if marks else self.started_at + stage[i].end

    @property
    def busy_s(self) -> list[float]:
        """Seconds each stage worked: on a GPU its tasks' time on the device (read from events, so
        this waits for them), elsewhere their wall time."""
        return [sum(clock_seconds(*pair) for pair in marks) if marks else sum(t.end - t.start for t in stage)
                for stage, marks in zip(self.timed, self.marks)]


@dataclass
class PassState:
    """Everything one forward pass leaves for its backward pass.

    ``micro_batch_stages[m]`` are the stage modules micro-batch m runs with: one list for all of them,
    unless the graph was captured again for a micro-batch of another shape.
    """

    record: StepRecord
    saved: list[dict[int, _Saved]] = field(default_factory=list)  # per stage, by micro-batch
    micro_batch_stages: list[Sequence[StageModule]] = field(default_factory=list)
    schedule: Schedule | None = None
    #: per stage, the count of what it keeps for backward (``None``: not measured)
    held: Sequence[HeldMemory] | None = None
    #: the seed random operations draw from (:mod:`lightning_antichain.stages.randomness`; ``None``: none draw)
    seed: int | None = None
    #: the autocast settings of the forward, which a recomputed forward runs under again
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=list)
    #: the replicas' reduction when the backward starts, armed before each stage's last backward
    #: (:class:`~lightning_antichain.in_process.stage_reduction.StageReduction`; ``None``: no replicas)
    reduction: Callable[[], Any] = lambda: None

    def counting(self, k: int) -> Any:
        """Count what stage ``k``'s autograd saves inside the block, when measuring."""
        return self.held[k].saving() if self.held is not None else nullcontext()

    def count(self, k: int, values: Sequence[Any]) -> Any:
        """A token that keeps ``values`` counted as stage ``k``'s until it is dropped."""
        return self.held[k].hold(values) if self.held is not None else None


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad


class _ThreadContext:
    """Thread-local settings of the caller that worker threads must re-enter."""

    def __init__(self, grad: bool) -> None:
        self.grad = grad
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = autocast_settings()

    def enter(self, streams: StageStreams, caller: CallerStreams) -> list[Any]:
        managers: list[Any] = [torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad),
                               computing(streams), *autocast_managers(self.autocast)]
        for manager in managers:
            manager.__enter__()
        wait_for_caller(streams, caller)
        return managers


def _run_workers(
    pool: WorkerPool,
    stages: Sequence[StageModule],
    body: Callable[[int, queue.Queue, queue.Queue, threading.Event], None],
    first: queue.Queue,
    last: queue.Queue,
    order: Sequence[int],
    grad: bool,
    count: int,
    width: int = 1,
) -> list[Any]:
    """Run ``body`` for every stage on the pool's workers, chained by queues; returns what the last
    worker passed on (see :func:`_collect`) and re-raises the first failure.

    Workers run with grad mode ``grad`` (the caller may be inside an autograd Function, where grad
    mode is off), with the caller's autocast settings, and on their stage's compute stream, after
    the caller's queued work; the caller's later work waits for theirs. After a failure the workers
    are stopped, so no thread outlives a failed pass.
    """
    links = [first] + [queue.Queue() for _ in range(len(stages) - 1)] + [last]
    abort = threading.Event()
    failures: list[_Failure] = []
    context = _ThreadContext(grad)
    caller = caller_streams(stage.device for stage in stages)

    def task(position: int) -> Callable[[], None]:
        def run() -> None:
            k = order[position]
            managers = context.enter(stages[k].streams, caller)
            try:
                body(k, links[position], links[position + 1], abort)
            except _StageFailed as failed:
                failures.append(failed.failure)
                abort.set()
                links[position + 1].put(ABORT)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failures.append(_Failure(k, -1, "pipeline", exc))
                abort.set()
                links[position + 1].put(ABORT)
            finally:
                for manager in reversed(managers):
                    manager.__exit__(None, None, None)

        return run

    def interrupt() -> None:
        abort.set()
        for link in links:
            link.put(ABORT)

    # worker i always serves stage i, so a stage's state stays on one thread
    tasks: list[Callable[[], None]] = [lambda: None] * len(stages)
    for position, k in enumerate(order):
        tasks[k] = task(position)
    pool.run(tasks, interrupt)
    if failures:
        pool.shutdown()
        raise _reraise(min(failures, key=lambda f: (f.micro_batch < 0, f.micro_batch, f.stage)))
    results = _collect(last, count, width)
    release_to_caller(caller, [stage.streams for stage in stages], results)
    return results


_Body = Callable[[int, queue.Queue, queue.Queue, threading.Event], None]


class _StageFailed(Exception):
    def __init__(self, failure: _Failure) -> None:
        super().__init__(str(failure.error))
        self.failure = failure


def _reraise(failure: _Failure) -> BaseException:
    where = f"pipeline stage {failure.stage}, micro-batch {failure.micro_batch}, {failure.phase}"
    error = failure.error
    if sys.version_info >= (3, 11):
        error.add_note(f"raised in {where}")
        return error
    return PipelineStageError(f"{type(error).__name__} in {where}: {error}")


def run_forward(
    pool: WorkerPool,
    micro_batch_stages: list[Sequence[StageModule]],
    micro_batches: list[tuple[list[Any], Any]],
    state: PassState | None,
    recompute_stop: int,
    schedule: Schedule | None = None,
    seed: int | None = None,
) -> list[tuple[list[Any], Any]]:
    """Forward every micro-batch through every stage; returns the last stage's output leaves and spec.

    ``micro_batches[m]`` is the flattened first-stage input of micro-batch m (leaves and spec), and
    ``micro_batch_stages[m]`` the stage modules it runs with. Each stage runs its forwards in the order of
    ``schedule`` (default: GPipe's). Random operations draw from ``seed`` (``state.seed`` when a
    state is given; see :mod:`lightning_antichain.stages.randomness`). With ``state`` given, autograd
    graphs (or, for micro-batches below ``recompute_stop``, just the inputs to recompute them from)
    are kept in it for :func:`run_backward`, which follows the same schedule.
    """
    stages = micro_batch_stages[0]
    schedule = schedule or gpipe(len(stages), len(micro_batches))
    first: queue.Queue = queue.Queue()
    last: queue.Queue = queue.Queue()
    for m in schedule.micro_batches(0, "forward"):
        leaves, spec = micro_batches[m]
        first.put((m, leaves, spec, None, tuple(_wants_grad(v) for v in leaves)))
    if state is not None:
        seed = state.seed
        state.autocast = autocast_settings()
        state.saved = [{} for _ in stages]
        state.micro_batch_stages = micro_batch_stages
        state.schedule = schedule

    def forward(k: int, m: int, values: tuple, spec: Any, event: Any, flags: tuple) -> tuple:
        streams = stages[k].streams
        target = stages[k + 1].streams if k + 1 < len(stages) else streams
        stage = micro_batch_stages[m][k]
        leaves = arrive(values, event, streams, flags if state is not None else [False] * len(values))
        if state is not None and m < recompute_stop:  # recomputed in backward: keep the inputs only
            with torch.no_grad(), drawing(seed, m):
                outputs, out_spec = stage(leaves, spec)
            forget_autocast_casts()
            out_flags = _recompute_flags(stage, leaves, outputs)
            state.saved[k][m] = _Saved(leaves, None, spec, state.count(k, leaves))
        elif state is not None:
            with state.counting(k), drawing(seed, m):
                outputs, out_spec = stage(leaves, spec)
            out_flags = tuple(_wants_grad(v) for v in outputs)
            state.saved[k][m] = _Saved(leaves, tuple(outputs), spec, state.count(k, [*leaves, *outputs]))
        else:
            with drawing(seed, m):
                outputs, out_spec = stage(leaves, spec)
            out_flags = tuple(_wants_grad(v) for v in outputs)
        shipped, event = ship(outputs, streams, target)
        return shipped, out_spec, event, out_flags

    body = _stage_loop("forward", schedule, pool, state.record if state is not None else None, forward, stages)
    return _run_workers(pool, stages, body, first, last, range(len(stages)), state is not None, len(micro_batches), 2)


def _stage_loop(phase: str, schedule: Schedule, pool: WorkerPool, record: StepRecord | None,
                task: Callable[..., tuple], stages: Sequence[StageModule]) -> _Body:
    """A stage worker's loop for ``phase``: take each micro-batch's item from the inbox in the
    schedule's order, run ``task(k, m, *item)`` on it, record it, and pass what it returns on.
    A failing task stops the pass with the stage, micro-batch and phase named."""

    def body(k: int, inbox: queue.Queue, outbox: queue.Queue, abort: threading.Event) -> None:
        arrived: dict[int, Any] = {}
        for m in schedule.micro_batches(k, phase):
            item = _next(m, inbox, arrived, abort)
            if item is ABORT:
                outbox.put(ABORT)
                return
            started = time.perf_counter()
            begin = start_clock(stages[k].streams) if record is not None else None
            try:
                result = task(k, m, *item[1:])
            except Exception as exc:
                raise _StageFailed(_Failure(k, m, phase, exc)) from exc
            if record is not None:
                end = None if begin is None else start_clock(stages[k].streams)
                record.add(Task(phase, k, m), started, None if begin is None else (begin, end))
            pool.count_task(k)
            outbox.put((m, *result))

    return body


def _next(m: int, inbox: queue.Queue, arrived: dict[int, Any], abort: threading.Event) -> Any:
    """Micro-batch ``m``'s item from ``inbox``, keeping any that arrive before it (``ABORT`` if the
    pass was given up)."""
    while m not in arrived:
        item = inbox.get()
        if item is ABORT or abort.is_set():
            return ABORT
        arrived[item[0]] = item
    return arrived.pop(m)


def _collect(last: queue.Queue, count: int, width: int = 1) -> list[Any]:
    """The values the last worker of a finished pass left, in micro-batch order.

    Each item is ``(m, value, ...)``; ``width`` > 1 keeps that many fields after ``m``.
    """
    results: list[Any] = [()] * count
    while not last.empty():
        item = last.get()
        if item is not ABORT:
            results[item[0]] = item[1] if width == 1 else tuple(item[1 : 1 + width])
    return results


def _recompute_flags(stage: StageModule, inputs: tuple, outputs: tuple) -> tuple[bool, ...]:
    """Which outputs would need gradients, for a stage run under ``no_grad``.

    Floating outputs do when any input does or the stage has trainable parameters, except outputs
    that are inputs passed straight through, which keep their input's flag.
    """
    trainable = stage.trainable
    any_input = any(_wants_grad(v) for v in inputs)
    by_id = {id(v): _wants_grad(v) for v in inputs if isinstance(v, torch.Tensor)}
    return tuple(
        by_id[id(v)]
        if id(v) in by_id
        else isinstance(v, torch.Tensor) and v.is_floating_point() and (trainable or any_input)
        for v in outputs
    )


def run_backward(
    pool: WorkerPool,
    state: PassState,
    output_grads: list[tuple[Any, ...]],
) -> list[tuple[Any, ...]]:
    """Backward every micro-batch through every stage, last to first, each stage in the order of
    the forward pass's schedule (GPipe: micro-batches last to first).

    ``output_grads[m]`` holds the gradients of the last stage's output leaves for micro-batch m
    (``None`` where a leaf got none). Returns the gradients of stage 0's input leaves per micro-batch.
    """
    stages = state.micro_batch_stages[0]
    schedule = state.schedule or gpipe(len(stages), len(output_grads))
    count = len(output_grads)
    first: queue.Queue = queue.Queue()
    last: queue.Queue = queue.Queue()
    for m in schedule.micro_batches(len(stages) - 1, "backward"):
        first.put((m, output_grads[m], None))
    # the GPU whose autograd thread waits in this backward: its stages' backward must run there
    waiting = autograd_thread_device(g for grads in output_grads for g in grads)
    final = [schedule.micro_batches(k, "backward")[-1] for k in range(len(stages))]
    reduction = state.reduction()

    def backward(k: int, m: int, grads: tuple, event: Any) -> tuple:
        streams = stages[k].streams
        target = stages[k - 1].streams if k > 0 else streams
        stage = state.micro_batch_stages[m][k]
        saved = state.saved[k][m]
        inputs, outputs = saved.inputs, saved.outputs
        restore = counted = None
        if outputs is None:
            with state.counting(k):
                outputs, restore = _recompute(stage, saved, state, m)
            counted = state.count(k, outputs)
        grads = arrive(grads, event, streams, [False] * len(grads))
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if reduction is not None and m == final[k] and pairs:
            reduction.before_last_backward(k, [o for o, _ in pairs])
        if pairs and waiting is not None and same_device(waiting, streams.device):
            pool.call_on_caller(functools.partial(_differentiate, pairs, streams))
        elif pairs:
            _differentiate(pairs, streams)
        if restore is not None:
            restore()
        input_grads = tuple(_grad_of(v) for v in inputs)
        state.saved[k][m] = _Saved((), None)  # free the activations as soon as possible
        del saved, inputs, outputs, pairs, counted
        return ship(input_grads, streams, target)

    body = _stage_loop("backward", schedule, pool, state.record, backward, stages)
    return _run_workers(pool, stages, body, first, last, list(reversed(range(len(stages)))), False, count)


def _differentiate(pairs: list[tuple[torch.Tensor, torch.Tensor]], streams: StageStreams) -> None:
    """Backpropagate each output's gradient through the stage, on its compute stream."""
    with computing(streams):
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _grad_of(value: Any) -> torch.Tensor | None:
    return value.grad if isinstance(value, torch.Tensor) and value.requires_grad else None


def _recompute(stage: StageModule, saved: _Saved, state: PassState, m: int) -> tuple[list[Any], Callable[[], None]]:
    """Run a recomputed micro-batch's forward again: its random operations draw what they drew
    the first time, under the forward's autocast, and BatchNorm statistics are not updated again
    (:class:`~lightning_antichain.stages.batchnorm.recomputing`, as the process runtime's stages).

    Returns the outputs and a function that puts back what the second forward changed of the
    buffers the stage's graph updates itself; call it after the backward, which may read them.
    """
    again = recomputing(stage.submodules(), stage.buffers(), restore_later=True)
    with torch.enable_grad(), drawing(state.seed, m), again, contextlib.ExitStack() as stack:
        for manager in autocast_managers(state.autocast):
            stack.enter_context(manager)
        outputs, _ = stage(saved.inputs, saved.spec)
    return outputs, again.restore
