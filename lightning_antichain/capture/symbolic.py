"""Frontend 1: ``torch.fx`` symbolic tracing.

Shape-generic and the cleanest graph when it works: leaf modules stay ``call_module`` nodes that run
the user's own module objects. It refuses Python control flow on tensor values and code that needs
real shapes (``assert t <= block_size``, ``torch.ones(t, t)``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .errors import FrontendRefused, first_line, location_of
from .signature import bind_placeholders
from .specialization import Specialization, constant_key


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


def constant_arguments(forward: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call that fx should take as constants: those left at a default that is
    not a tensor, and those passed as ``None`` or a bool. Traced as placeholders, ``if mask is None``
    would take the other branch and ``if flag:`` could not be traced."""
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    constants = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name in bound.arguments:
            value = bound.arguments[name]
            if value is None or isinstance(value, bool):
                constants[name] = value
        elif parameter.default is not inspect.Parameter.empty and not isinstance(parameter.default, torch.Tensor):
            constants[name] = parameter.default
    return constants


def capture_symbolic(module: nn.Module, leaf_modules: Sequence[type | str] = (),
                     constants: dict[str, Any] | None = None) -> fx.GraphModule:
    """The fx trace of ``module``, with ``constants`` (by argument name) baked in and guarded;
    raises :class:`FrontendRefused` naming the cause and the line."""
    tracer = LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(module, concrete_args=constants or None)
    except FrontendRefused as exc:  # a call the graph may not take apart (a custom autograd Function's)
        raise FrontendRefused(exc.reason, module_path=tracer.path[-1] if tracer.path else "",
                              location=location_of(exc)) from exc
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
    if constants:
        _restore_parameters(graph, inspect.signature(type(module).forward))
        _drop_guards(graph)
    return fx.GraphModule(tracer.root, _canonical_names(graph), type(module).__name__)


def _canonical_names(graph: fx.Graph) -> fx.Graph:
    """``graph`` with names that depend only on its own nodes, in order.

    fx never gives a name twice in a graph, even one whose node it deleted: tracing with constant
    arguments makes and drops guards, and the nodes after them came out as ``_assert_2`` and
    ``attn_mask_1`` where a trace without constants names them ``_assert`` and ``attn_mask``. A
    plan names operations, so two captures of one model must name them alike. Functions and
    methods take their name from what they call, numbered in order; placeholders are named after
    their argument; modules and attributes keep their paths.
    """
    fresh = fx.Graph(tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    fresh._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            name = str(node.target).lstrip("*")
        elif node.op in ("call_function", "call_method"):
            name = re.sub(r"_\d+$", "", node.name)
        else:
            name = node.name
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        env[node] = fresh.create_node(node.op, node.target, args, kwargs, name, node.type)
        env[node].meta = dict(node.meta)
    return fresh


def _kind(value: Any) -> Hashable:
    """What an fx graph depends on in an argument that it takes as a value: tensor, ``None`` or type."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "none" if value is None else type(value).__name__


def _restore_parameters(graph: fx.Graph, signature: inspect.Signature) -> None:
    """fx renames a constant argument's placeholder (``lengths_1``) and makes the traced value its
    default; calls bind by ``forward``'s own names and defaults, so put those back."""
    parameters = list(signature.parameters.values())[1:]  # without self
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(parameters) != len(placeholders):
        return
    for node, parameter in zip(placeholders, parameters):
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        node.target = parameter.name
        node.args = () if parameter.default is inspect.Parameter.empty else (parameter.default,)


def _drop_guards(graph: fx.Graph) -> None:
    """Remove fx's asserts on constant arguments: the runtime checks them before a call instead
    (:func:`call_specialization`), and traces again where they differ."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and any(
                isinstance(a, str) and "has been specialized to have value" in a for a in node.args):
            guarded = node.args[0]
            graph.erase_node(node)
            if isinstance(guarded, fx.Node) and guarded.op == "call_function" and not guarded.users:
                graph.erase_node(guarded)  # the ``flag == False`` the assert read


def call_specialization(graph_module: fx.GraphModule, constants: dict[str, Any], call: tuple[tuple, dict] | None,
                        recapture: Callable[[tuple, dict], Any]) -> Specialization:
    """What an fx graph traced on ``call`` with ``constants`` baked in holds for: calls with the same
    constants, and tensors, ``None`` and other values where the call had them (a mask where there was
    none, or ``None`` where a tensor was traced, is traced again). Traced without a call, every
    argument was a traced value: the graph holds for tensors."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    baked = [n.target in constants for n in placeholders]

    def describe(values: Sequence[Any]) -> Hashable:
        return tuple(constant_key(v) if is_constant and not isinstance(v, torch.Tensor) else _kind(v)
                     for is_constant, v in zip(baked, values))

    if call is None:
        return Specialization(("tensor",) * len(placeholders), (), recapture, describe)
    bound = bind_placeholders(placeholders, *call)
    return Specialization(describe([bound[n.name] for n in placeholders]), (), recapture, describe)
