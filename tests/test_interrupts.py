"""Ctrl-C at any moment of a pipelined step ends every worker, and the next step works.

Two ways to land an interrupt, neither depending on timing: a stage sends a real SIGINT to the
main thread at a chosen forward or backward task and waits until it has been handled (stages also
sleep a little at random, so the main thread is caught in many places), and a trace function
raises KeyboardInterrupt at the N-th line the runtime runs on the main thread, for N across a
whole step: handing out tasks, waiting, scattering, gathering, inside autograd's backward.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest
import torch
from torch import nn

import lightning_antichain as la

TRIP: dict = {"phase": None, "at": -1, "calls": 0, "delay": 0.0}
_lock = threading.Lock()
_handled = threading.Event()
_RUNTIME_FILES = ("pipeline.py", "engine.py", "worker.py")


def tripwire(x: torch.Tensor) -> torch.Tensor:
    """Identity that may sleep, and may interrupt the main thread at its ``TRIP["at"]``-th call."""
    return _Trip.apply(x)


torch.fx.wrap("tripwire")


class _Trip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _maybe_trip("forward")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _maybe_trip("backward")
        return grad


def _maybe_trip(phase: str) -> None:
    with _lock:
        fire = TRIP["phase"] == phase and TRIP["calls"] == TRIP["at"]
        TRIP["calls"] += TRIP["phase"] == phase
    if TRIP["delay"]:
        time.sleep(random.uniform(0, TRIP["delay"]))
    if fire:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        _handled.wait(10)  # the main thread is told at once, wherever it waits


class Tripping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = tripwire(torch.tanh(layer(x)))
        return x


def alive(threads: list[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threads if t.is_alive()]


def _in_runtime(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(_RUNTIME_FILES) and "lightning_antichain" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def interrupts():
    """SIGINT and SIGALRM raise KeyboardInterrupt and record whether the runtime was running."""
    landed: list[bool] = []

    def handler(signum, frame):
        landed.append(_in_runtime(frame))
        _handled.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGALRM)}
    try:
        yield landed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in old.items():
            signal.signal(s, h)
        TRIP.update(phase=None, at=-1, calls=0, delay=0.0)


def _pipe() -> tuple[nn.Module, la.Pipeline]:
    torch.manual_seed(0)
    model = Tripping().double()
    cost = la.profile(model, torch.randn(2, 8, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    return model, la.Pipeline(model, la.partition(cost, 3), chunks=4)


def _check_next_step_is_right(model: nn.Module, pipe: la.Pipeline) -> None:
    x = torch.randn(8, 8, dtype=torch.float64)
    model.zero_grad()
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    model.zero_grad()
    pipe(x).square().sum().backward()
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("repeat", range(20))
def test_an_interrupt_sent_by_a_stage_ends_every_worker(interrupts, repeat):
    model, pipe = _pipe()
    rng = random.Random(repeat)
    pipe(torch.randn(8, 8, dtype=torch.float64)).square().sum().backward()
    workers = list(pipe._pool._threads)
    TRIP.update(phase=rng.choice(["forward", "backward"]), at=rng.randrange(12), calls=0, delay=0.004)
    _handled.clear()
    with pytest.raises(KeyboardInterrupt):
        pipe(torch.randn(8, 8, dtype=torch.float64)).square().sum().backward()
    assert interrupts == [True], "the interrupt reached the main thread outside the pipeline"
    assert len(workers) == 3 and alive(workers) == [] and pipe._pool._threads == []
    TRIP.update(phase=None, delay=0.0)
    _check_next_step_is_right(model, pipe)
    workers = list(pipe._pool._threads)
    pipe.close()
    assert alive(workers) == []


class _InterruptAtLine:
    """A trace function for the main thread that counts the lines the runtime runs and raises
    KeyboardInterrupt at line ``at``, as a Ctrl-C landing there would (``at=None``: only count)."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.lines = 0
        self.fired = False

    #: the guards that stop the workers: their own first line runs before they guard anything
    GUARDS = (la.Pipeline.forward.__code__, la.in_process.autograd_bridge.PipelineFunction.backward.__code__)

    def __call__(self, frame, event, arg):
        if "lightning_antichain" not in frame.f_code.co_filename or frame.f_code in self.GUARDS:
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.fired = True
                raise KeyboardInterrupt
        return self


def _step(pipe: la.Pipeline, x: torch.Tensor, trace: _InterruptAtLine) -> None:
    import sys

    sys.settrace(trace)
    try:
        pipe(x).square().sum().backward()
    finally:
        sys.settrace(None)


def test_an_interrupt_at_any_line_the_runtime_runs_leaves_no_worker_behind():
    """Every moment of the main thread's part of a step, forward and backward, one after another."""
    model, pipe = _pipe()
    x = torch.randn(16, 8, dtype=torch.float64)
    pipe(x).square().sum().backward()  # the first call's own work (checks, capture) is done once
    counting = _InterruptAtLine()
    _step(pipe, x, counting)
    total = counting.lines
    assert total > 200
    for at in range(1, total + 1, max(1, total // 150)):
        workers = list(pipe._pool._threads)
        trace = _InterruptAtLine(at)
        with pytest.raises(KeyboardInterrupt):
            _step(pipe, x, trace)
        assert trace.fired
        assert len(workers) == 3 and alive(workers) == [], f"an interrupt at line {at} of {total} left workers running"
        _check_next_step_is_right(model, pipe)
    pipe.close()
