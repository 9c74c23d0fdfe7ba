"""Turn an ``nn.Module`` into a graph of operations that the planner can cost and cut.

Two granularities exist:

* ``"ops"``: a ``torch.fx`` trace. Every leaf module call (``Conv2d``, ``Linear``, ...) and every
  functional or method call (``torch.cat``, ``x.view``, ``+``) is a node; tensors are the edges. This
  is what the method of the paper needs: fine cut points and exact data dependencies.
* ``"children"``: the fallback for models fx cannot trace (data-dependent Python control flow). Each
  call of a top-level child module is a node, in call order; edges follow the tensors handed from
  one child to the next, found by running the model once. Coarser, but always available.

The result, an :class:`OpGraph`, knows how to replay the model one node at a time on concrete
inputs (:meth:`OpGraph.record_calls`), which is what the profiler times.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

GRANULARITIES = ("ops", "children")


class UntraceableModelError(RuntimeError):
    """``torch.fx`` could not trace the model, and no fallback was allowed."""


@dataclass(frozen=True)
class OpNode:
    """One operation of the model: what it calls and which nodes feed it.

    ``owner`` is the dotted path of the module whose ``forward`` issued the call, ``""`` for the
    model's own ``forward``; the block baseline groups nodes by its first component.
    """

    name: str
    kind: str
    target: str
    inputs: tuple[str, ...]
    owner: str = ""

    @property
    def top_level(self) -> str:
        """The top-level child this node belongs to, or its own name if issued at top level."""
        return self.owner.split(".")[0] if self.owner else self.name


@dataclass(frozen=True)
class RecordedCall:
    """A node together with the concrete callable, arguments and output of one real run."""

    node: OpNode
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    module: nn.Module | None


@dataclass
class OpGraph:
    """The operations of a module in a topological (execution) order.

    ``outputs`` names the nodes whose values the module returns. ``graph_module`` is the fx trace for
    ``"ops"`` granularity (the runtime builds stage modules from it), ``None`` for ``"children"``.
    ``note`` says why a fallback was taken, if one was.
    """

    module: nn.Module
    nodes: list[OpNode]
    outputs: tuple[str, ...]
    granularity: str
    graph_module: fx.GraphModule | None = None
    note: str | None = None
    _by_name: dict[str, OpNode] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def __getitem__(self, name: str) -> OpNode:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.nodes)

    def record_calls(self, *args: Any, **kwargs: Any) -> Iterator[RecordedCall]:
        """Run the module on real inputs, yielding every node's call with its concrete values."""
        if self.granularity == "ops":
            yield from _record_fx_calls(self, args, kwargs)
        else:
            yield from _record_child_calls(self, args, kwargs)


class _LeafTracer(fx.Tracer):
    """The default fx tracer, plus user-chosen leaf modules (by class or by dotted path)."""

    def __init__(self, leaf_modules: Sequence[type | str] = ()) -> None:
        super().__init__()
        self._leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self._leaf_paths = {m for m in leaf_modules if isinstance(m, str)}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_paths or isinstance(m, self._leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace(
    module: nn.Module,
    example_inputs: Any = None,
    *,
    granularity: str = "ops",
    fallback: str | None = "children",
    leaf_modules: Sequence[type | str] = (),
) -> OpGraph:
    """Build the :class:`OpGraph` of ``module``.

    ``granularity="ops"`` traces with ``torch.fx``. If that fails and ``fallback="children"``, the
    top-level children become the nodes (``example_inputs`` is then required, since the data flow
    between children is observed by running the model); with ``fallback=None`` an
    :class:`UntraceableModelError` names the cause instead. ``leaf_modules`` keeps the listed module
    classes or dotted paths as single nodes, e.g. a block with data-dependent control flow inside.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if fallback not in (None, "children"):
        raise ValueError(f"fallback must be None or 'children', got {fallback!r}")
    if granularity == "ops":
        try:
            return _trace_ops(module, leaf_modules)
        except UntraceableModelError as exc:
            if fallback is None:
                raise
            if example_inputs is None:
                raise UntraceableModelError(
                    f"{exc} The 'children' fallback needs example inputs to observe the data flow."
                ) from exc
            graph = _trace_children(module, example_inputs)
            graph.note = f"fell back to top-level children: {exc}"
            return graph
    if example_inputs is None:
        raise ValueError("granularity='children' needs example_inputs to observe the data flow")
    return _trace_children(module, example_inputs)


def _trace_ops(module: nn.Module, leaf_modules: Sequence[type | str]) -> OpGraph:
    tracer = _LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        raise UntraceableModelError(_explain_trace_failure(module, exc)) from exc
    graph_module = fx.GraphModule(tracer.root, graph, type(module).__name__)
    nodes: list[OpNode] = []
    outputs: tuple[str, ...] = ()
    for node in graph_module.graph.nodes:
        if node.op == "output":
            outputs = tuple(n.name for n in node.all_input_nodes)
            continue
        nodes.append(
            OpNode(
                name=node.name,
                kind=node.op,
                target=_target_name(node),
                inputs=tuple(n.name for n in node.all_input_nodes),
                owner=_owner(node),
            )
        )
    return OpGraph(module, nodes, outputs, "ops", graph_module=graph_module)


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__qualname__", None) or getattr(node.target, "__name__", str(node.target))


def _owner(node: fx.Node) -> str:
    """The dotted path of the module whose forward issued ``node``."""
    if node.op == "call_module":
        path = str(node.target)
        return path.rsplit(".", 1)[0] if "." in path else ""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return str(path)


def _explain_trace_failure(module: nn.Module, exc: Exception) -> str:
    where = ""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f"{os.sep}torch{os.sep}" not in f.filename and "lightning_antichain" not in f.filename
    ]
    if frames:
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})"
    if isinstance(exc, fx.proxy.TraceError):
        cause = "This means Python control flow (if, while, bool()) on tensor values; make the branch static"
    else:
        cause = "fx records calls symbolically and this code needs real values or objects"
    return (
        f"torch.fx cannot trace {type(module).__name__}{where}: {type(exc).__name__}: {exc}. {cause}, "
        "keep the offending submodule whole with leaf_modules=[...], or plan over the top-level children "
        "with fallback='children'."
    )


def _record_fx_calls(graph: OpGraph, args: tuple, kwargs: dict) -> Iterator[RecordedCall]:
    assert graph.graph_module is not None
    gm = graph.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound = bind_placeholders(placeholders, args, kwargs, f"{type(graph.module).__name__}.forward")
    env: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            return
        op = graph[node.name]
        module = None
        if node.op == "placeholder":
            value = bound[node.name]
            fn: Callable[..., Any] = _identity
            call_args: tuple = (value,)
            call_kwargs: dict = {}
        else:
            call_args = fx.node.map_arg(node.args, lambda n: env[n.name])
            call_kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                fn = module
            elif node.op == "call_function":
                fn = node.target
            elif node.op == "call_method":
                fn = _MethodCall(node.target)
            elif node.op == "get_attr":
                fn = _AttrFetch(gm, node.target)
            else:  # pragma: no cover - fx has no other node kinds
                raise RuntimeError(f"unexpected fx node kind {node.op}")
            value = fn(*call_args, **call_kwargs)
        env[node.name] = value
        yield RecordedCall(op, fn, tuple(call_args), dict(call_kwargs), value, module)


def bind_placeholders(placeholders: list[fx.Node], args: tuple, kwargs: dict, owner: str = "forward") -> dict[str, Any]:
    """Map a call's arguments onto the fx placeholders of ``forward``, defaults included."""
    bound: dict[str, Any] = {}
    positional = list(args)
    for node in placeholders:
        name = str(node.target).lstrip("*")
        if positional:
            bound[node.name] = positional.pop(0)
        elif name in kwargs:
            bound[node.name] = kwargs[name]
        elif node.args:
            bound[node.name] = node.args[0]
        else:
            raise TypeError(f"{owner}() missing argument {name!r}")
    if positional:
        raise TypeError(f"{owner}() got {len(args)} positional arguments, {len(args) - len(positional)} expected")
    return bound


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor inside its tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(fn, v) for v in value)
    if isinstance(value, list):
        return [map_tensors(fn, v) for v in value]
    if isinstance(value, dict):
        return type(value)((k, map_tensors(fn, v)) for k, v in value.items())
    return value


def _identity(value: Any) -> Any:
    return value


class _MethodCall:
    """Calls a tensor method by name, e.g. ``x.view(...)``; picklable and printable."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.method)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<method {self.method}>"


class _AttrFetch:
    """Fetches a parameter or buffer by dotted path (an fx ``get_attr`` node)."""

    def __init__(self, root: nn.Module, path: str) -> None:
        self.root, self.path = root, path

    def __call__(self) -> Any:
        value: Any = self.root
        for part in self.path.split("."):
            value = getattr(value, part)
        return value


def _trace_children(module: nn.Module, example_inputs: Any) -> OpGraph:
    if not any(True for _ in module.children()):
        raise UntraceableModelError(
            f"{type(module).__name__} has no child modules to fall back on; it cannot be pipelined."
        )
    args, kwargs = split_inputs(example_inputs)
    records, outputs = _observe_children(module, args, kwargs)
    return OpGraph(module, [r.node for r in records], outputs, "children")


def _record_child_calls(graph: OpGraph, args: tuple, kwargs: dict) -> Iterator[RecordedCall]:
    records, _ = _observe_children(graph.module, args, kwargs)
    if [r.node.name for r in records] != [n.name for n in graph.nodes]:
        raise RuntimeError(
            f"{type(graph.module).__name__} called its children in a different order on these inputs; "
            "the children fallback needs a fixed call order."
        )
    yield from records


def _observe_children(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[RecordedCall], tuple]:
    """Run the model once with hooks on its children, recording calls and the tensors between them."""
    producer: dict[int, str] = {}
    records: list[RecordedCall] = []
    for i, tensor in enumerate(iter_tensors((args, kwargs))):
        node = OpNode(f"input_{i}", "placeholder", f"input_{i}", ())
        producer[id(tensor)] = node.name
        records.append(RecordedCall(node, _identity, (tensor,), {}, tensor, None))
    n_inputs = len(records)
    counts: dict[str, int] = {}
    pending: dict[int, tuple[tuple, dict]] = {}

    def pre_hook(mod: nn.Module, hook_args: tuple, hook_kwargs: dict) -> None:
        pending[id(mod)] = (hook_args, dict(hook_kwargs))

    def post_hook(child_name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, hook_args: tuple, hook_kwargs: dict, output: Any) -> None:
            call_args, call_kwargs = pending.pop(id(mod), (hook_args, dict(hook_kwargs)))
            counts[child_name] = counts.get(child_name, 0) + 1
            name = child_name + ("" if counts[child_name] == 1 else f"_{counts[child_name]}")
            inputs: list[str] = []
            for tensor in iter_tensors((call_args, call_kwargs)):
                # A tensor made by code between children depends on the previous call.
                src = producer.get(id(tensor), records[-1].node.name)
                if src not in inputs:
                    inputs.append(src)
            if not inputs and len(records) > 0:
                inputs.append(records[-1].node.name)
            node = OpNode(name, "call_module", child_name, tuple(inputs))
            for tensor in iter_tensors(output):
                producer[id(tensor)] = name
            records.append(RecordedCall(node, mod, tuple(call_args), call_kwargs, output, mod))

        return hook

    handles = []
    for child_name, child in module.named_children():
        handles.append(child.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(child.register_forward_hook(post_hook(child_name), with_kwargs=True))
    try:
        result = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if len(records) == n_inputs:
        raise UntraceableModelError(
            f"{type(module).__name__}.forward calls none of its child modules; it cannot be pipelined."
        )
    outputs = tuple(dict.fromkeys(producer.get(id(t), records[-1].node.name) for t in iter_tensors(result)))
    return records, outputs or (records[-1].node.name,)


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Lightning's ``example_input_array`` convention: tuple = positional, dict = keyword, else one arg."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return (example_inputs,), {}


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
