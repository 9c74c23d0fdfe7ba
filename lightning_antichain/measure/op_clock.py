"""What each operation of a stage takes inside the stage's real forward and backward passes.

An operation timed alone, as the profiler does, is not what it takes in its stage: there it finds
its input out of the caches, shares the memory bandwidth and the cores with what runs beside it,
and on a GPU its kernels queue behind the others'. The planner folds these in-context times into
its costs (:mod:`~lightning_antichain.planner.rebalance`), so it can tell which operations of a
stage that measured slow are the slow ones.

Forward: the stage runs a copy of its graph with a call after every operation that marks the
stage's clock (no interpreter). Backward: each operation's output gets a pre-hook on its autograd
node, marking when the backward reached it; an operation takes the time until the next mark
(its own autograd nodes run in between: they were created together, and autograd runs the most
recently created ready node first). Marks are the device layer's
(:func:`~lightning_antichain.device.mark`): the wall clock on the CPU, events on the
stage's compute stream on a GPU, read once the passes are over.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from ..capture.lifted import share_original_modules
from ..capture.pytrees import iter_tensors
from ..device import Device, mark, seconds_between

_watching = threading.local()


class OpClock:
    """Seconds each operation of one stage on ``device`` took, forward and backward, summed over
    the passes it watched. A backward counts once :meth:`backward_ended` says when it ended."""

    def __init__(self, device: Device = "cpu") -> None:
        self.device = device
        self._forward: list[tuple[str, Any, Any]] = []
        self._backward: list[tuple[str, Any, Any]] = []
        self._last: Any = None
        self._reached: list[tuple[Any, str]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        self._last = mark(self.device)

    def passed(self, name: str, value: Any) -> None:
        """Operation ``name`` just returned ``value``."""
        self._forward.append((name, self._last, mark(self.device)))
        if torch.is_grad_enabled():
            hooked: set[int] = set()
            for tensor in iter_tensors(value):
                node = tensor.grad_fn
                if node is not None and id(node) not in hooked:
                    hooked.add(id(node))
                    node.register_prehook(_Reached(self, name))
        self._last = mark(self.device)

    def reached(self, name: str) -> None:
        with self._lock:
            self._reached.append((mark(self.device), name))

    def backward_ended(self, at: Any) -> None:
        """The backward that reached the operations marked since the last call ended at mark
        ``at`` (on the CPU, a ``time.perf_counter()`` reading): each operation takes the time until
        the next mark, the last one until ``at``. Autograd runs a stage's backward on one thread,
        so the marks are in the order they were made."""
        with self._lock:
            reached, self._reached = self._reached, []
        self._backward += [(name, when, after) for (when, name), (after, _) in zip(reached, [*reached[1:], (at, "")])]

    @property
    def forward_s(self) -> dict[str, float]:
        return _summed(self._forward)

    @property
    def backward_s(self) -> dict[str, float]:
        return _summed(self._backward)


def _summed(spans: list[tuple[str, Any, Any]]) -> dict[str, float]:
    total: defaultdict[str, float] = defaultdict(float)
    for name, begin, end in spans:
        total[name] += max(0.0, seconds_between(begin, end))
    return dict(total)


class _Reached:
    """An autograd pre-hook marking that the backward reached operation ``name``."""

    def __init__(self, clock: OpClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __call__(self, grad_outputs: Any) -> None:
        self.clock.reached(self.name)


def clocked_module(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of the stage graph ``module`` that reports every operation it runs to the clock
    watching the calling thread (:func:`watching`). It calls the same modules and reads the same
    tensors as ``module``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    started = False
    for node in module.graph.nodes:
        if node.op not in ("placeholder", "get_attr") and not started:
            graph.call_function(_start, ())
            started = True
        copy = graph.node_copy(node, lambda n: env[n])
        env[node] = copy
        if node.op in ("call_function", "call_method", "call_module"):
            graph.call_function(_passed, (node.name, copy))
    clocked = fx.GraphModule(module, graph, f"{type(module).__name__}Clocked")
    return share_original_modules(clocked, module)


@contextlib.contextmanager
def watching(clock: OpClock) -> Iterator[OpClock]:
    """Report the operations of clocked modules that the calling thread runs to ``clock``."""
    before = getattr(_watching, "clock", None)
    _watching.clock = clock
    try:
        yield clock
    finally:
        _watching.clock = before


def _start() -> None:
    clock = getattr(_watching, "clock", None)
    if clock is not None:
        clock.start()


def _passed(name: str, value: Any) -> None:
    clock = getattr(_watching, "clock", None)
    if clock is not None:
        clock.passed(name, value)
