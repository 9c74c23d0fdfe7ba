"""What each operation of a CPU stage takes inside the stage's real forward and backward passes.

An operation timed alone, as the profiler does, is not what it takes in its stage: there it finds
its input out of the caches, shares the memory bandwidth and the cores with what runs beside it.
The planner folds these in-context times into its costs (:mod:`~lightning_antichain.planner.rebalance`),
so it can tell which operations of a stage that measured slow are the slow ones.

Forward: the stage runs a copy of its graph with a call after every operation that reads the
wall clock (a fraction of a microsecond; no interpreter). Backward: each operation's output gets
a pre-hook on its autograd node, noting when the backward reached it; an operation takes the time
until the next noted one (its own autograd nodes run in between: they were created together, and
autograd runs the most recently created ready node first). CPU only: a GPU operation returns
before its kernel ends, so wall clocks there would time the launches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from ..capture.lifted import share_original_modules
from ..capture.pytrees import iter_tensors

_watching = threading.local()


class OpClock:
    """Seconds each operation of one stage took, forward and backward, summed over the passes it
    watched. A backward's times are known once :meth:`backward_ended` says when it ended."""

    def __init__(self) -> None:
        self.forward_s: defaultdict[str, float] = defaultdict(float)
        self.backward_s: defaultdict[str, float] = defaultdict(float)
        self._last = 0.0
        self._reached: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        self._last = time.perf_counter()

    def passed(self, name: str, value: Any) -> None:
        """Operation ``name`` just returned ``value``."""
        self.forward_s[name] += time.perf_counter() - self._last
        if torch.is_grad_enabled():
            hooked: set[int] = set()
            for tensor in iter_tensors(value):
                node = tensor.grad_fn
                if node is not None and id(node) not in hooked:
                    hooked.add(id(node))
                    node.register_prehook(_Reached(self, name))
        self._last = time.perf_counter()

    def reached(self, name: str) -> None:
        with self._lock:
            self._reached.append((time.perf_counter(), name))

    def backward_ended(self, at: float) -> None:
        """The backward that reached the operations noted since the last call ended at ``at`` (a
        ``time.perf_counter()`` reading): each takes the time until the next one, the last until ``at``."""
        with self._lock:
            reached, self._reached = sorted(self._reached), []
        for (when, name), (after, _) in zip(reached, [*reached[1:], (at, "")]):
            self.backward_s[name] += max(0.0, after - when)

    def clear(self) -> None:
        self.forward_s.clear()
        self.backward_s.clear()
        with self._lock:
            self._reached.clear()


class _Reached:
    """An autograd pre-hook noting that the backward reached operation ``name``."""

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

