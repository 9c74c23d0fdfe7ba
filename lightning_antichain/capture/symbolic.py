"""Frontend 1: ``torch.fx`` symbolic tracing.

Shape-generic and the cleanest graph when it works: leaf modules stay ``call_module`` nodes that run
the user's own module objects. It refuses Python control flow on tensor values and code that needs
real shapes (``assert t <= block_size``, ``torch.ones(t, t)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from .errors import FrontendRefused, first_line, location_of


class LeafTracer(fx.Tracer):
    """The default fx tracer, plus user-chosen leaf modules (by class or by dotted path).

    It remembers the path of the modules it is inside, so a failure can name the submodule whose
    ``forward`` could not be traced.
    """

    def __init__(self, leaf_modules: Sequence[type | str] = ()) -> None:
        super().__init__()
        # buffers become graph values, not constants: a branch on one (``if self.flag:``) must be
        # refused rather than baked into the graph with the value it had while tracing
        self.proxy_buffer_attributes = True
        self._leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self._leaf_paths = {m for m in leaf_modules if isinstance(m, str)}
        self.path: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_paths or isinstance(m, self._leaf_types):
            return True
        if next(m.children(), None) is not None:
            # fx keeps every torch.nn module whole; containers such as nn.Transformer would then be one
            # operation that no plan can cut, so trace into them (or let a later frontend capture them)
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        self.path.append(self.path_of_module(m))
        result = super().call_module(m, forward, args, kwargs)
        self.path.pop()
        return result


def capture_symbolic(module: nn.Module, leaf_modules: Sequence[type | str] = ()) -> fx.GraphModule:
    """The fx trace of ``module``; raises :class:`FrontendRefused` naming the cause and the line."""
    tracer = LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, AssertionError, ...
        where = location_of(exc)
        if isinstance(exc, fx.proxy.TraceError):
            cause = "Python control flow (if, while, bool(), assert) on a traced value"
        else:
            cause = "code that needs real values or shapes"
        reason = f"{type(exc).__name__}: {first_line(exc)} ({cause}{', at ' + where if where else ''})"
        if "(assert " in where:
            reason += "; fx traces torch._assert(condition, message) where it cannot trace assert"
        raise FrontendRefused(reason, module_path=tracer.path[-1] if tracer.path else "", location=where) from exc
    return fx.GraphModule(tracer.root, graph, type(module).__name__)
