"""The captured graph of operations that the profiler costs, the planner cuts and the runtime runs.

Every frontend ends in an ``fx.GraphModule``; :func:`op_graph` turns it into an :class:`OpGraph`.
Parameter and buffer fetches (``get_attr`` nodes) are not operations of their own: they are
folded into the operations that read them (``OpNode.state``), since any stage can fetch them. That
keeps an ATen graph, where every weight is fetched, from having hundreds of free source nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .assignments import Assignment
from .kept import KeptCache
from .mutations import ordering
from .signature import FlatSignature, FxSignature
from .specialization import Specialization


def block_of(path: str) -> str | None:
    """The element of a module list that the module at ``path`` is or belongs to
    (``model.layers.17`` for ``model.layers.17.mlp``), if any: a block, such as a decoder layer."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


@dataclass(frozen=True)
class OpNode:
    """One operation of the model: what it calls, which nodes feed it, which state it reads.

    ``owner`` is the dotted path of the module whose ``forward`` issued the call, ``""`` for the
    model's own ``forward``; the block baseline groups nodes by its first component. ``state``
    names the parameters and buffers it fetches directly (not those inside a called module).
    ``after`` names nodes that must run before it without feeding it: in-place operations on a
    tensor it reads, or readers of a tensor it changes in place (:mod:`.mutations`).
    """

    name: str
    kind: str
    target: str
    inputs: tuple[str, ...]
    owner: str = ""
    state: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    @property
    def block(self) -> str | None:
        """The element of a module list (``layers.17``) whose code issued this operation, if any."""
        return block_of(self.target if self.kind == "call_module" else self.owner)

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
    state: tuple[tuple[str, torch.Tensor], ...] = ()


@dataclass
class OpGraph:
    """The operations of a module in a topological (execution) order, and how they were captured.

    ``outputs`` names the nodes whose values the module returns. ``graph_module`` runs them (the
    runtime cuts stage modules out of it); it is ``None`` only for the planning-only ``"children"``
    granularity. ``frontend`` names the capture frontend that produced it and ``refused`` says why
    the ones before it could not; ``signature`` maps a call onto the placeholders and the outputs
    back; ``specialization`` says which inputs the graph holds for (``None``: any);
    ``capture_device`` is the device the graph's tensor constructors name (``None``: none);
    ``assignments`` are the attributes ``forward`` assigns, replayed by the runtime after each call;
    each group of ``together`` must share a stage (views read across an in-place change);
    ``training`` holds the ``training`` flag of every submodule (``module.modules()`` order) at
    capture, since the graph bakes in the mode (dropout, BatchNorm, ``if self.training:``);
    ``cache`` the attributes ``forward`` built once that the graph reads (``None``: none).
    """

    module: nn.Module
    nodes: list[OpNode]
    outputs: tuple[str, ...]
    granularity: str
    graph_module: fx.GraphModule | None = None
    note: str | None = None
    frontend: str = "fx"
    refused: tuple[str, ...] = ()
    signature: FxSignature | FlatSignature | None = None
    specialization: Specialization | None = None
    capture_device: str | None = None
    assignments: tuple[Assignment, ...] = ()
    together: tuple[tuple[str, ...], ...] = ()
    recorder: Callable[[OpGraph, tuple, dict], Iterator[RecordedCall]] | None = field(default=None, repr=False)
    training: tuple[bool, ...] | None = None
    cache: KeptCache | None = None
    _by_name: dict[str, OpNode] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def __getitem__(self, name: str) -> OpNode:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.nodes)

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """The placeholder values of a call, in placeholder order."""
        assert self.signature is not None
        return self.signature.bind(args, kwargs)

    def record_calls(self, *args: Any, **kwargs: Any) -> Iterator[RecordedCall]:
        """Run the module on real inputs, yielding every node's call with its concrete values."""
        if self.recorder is not None:
            yield from self.recorder(self, args, kwargs)
        else:
            yield from _record_graph_calls(self, args, kwargs)

    def rebound(self, graph_module: fx.GraphModule | None, module: nn.Module) -> OpGraph:
        """The same graph over another copy of the module (the profiler's)."""
        return OpGraph(module, self.nodes, self.outputs, self.granularity, graph_module, self.note, self.frontend,
                       self.refused, self.signature, self.specialization, self.capture_device, self.assignments,
                       self.together, self.recorder, self.training, self.cache)


def op_graph(module: nn.Module, graph_module: fx.GraphModule, frontend: str, signature: Any = None,
             specialization: Specialization | None = None) -> OpGraph:
    """The :class:`OpGraph` of a captured graph module, with parameter fetches folded in."""
    attrs = {n.name: n for n in graph_module.graph.nodes if n.op == "get_attr"}
    orders = ordering(graph_module)
    nodes: list[OpNode] = []
    outputs: tuple[str, ...] = ()
    for node in graph_module.graph.nodes:
        if node.op == "output":
            outputs = tuple(n.name for n in node.all_input_nodes if n.name not in attrs)
            continue
        if node.op == "get_attr":
            continue
        inputs = node.all_input_nodes
        nodes.append(
            OpNode(
                name=node.name,
                kind=node.op,
                target=_target_name(node),
                inputs=tuple(n.name for n in inputs if n.name not in attrs),
                owner=_owner(node),
                state=tuple(str(n.target) for n in inputs if n.name in attrs and _is_tensor_attr(graph_module, n)),
                after=tuple(n for n in orders.after.get(node.name, ()) if n not in attrs),
            )
        )
    if signature is None:
        signature = FxSignature(graph_module, f"{type(module).__name__}.forward")
    graph = OpGraph(module, nodes, outputs, "ops", graph_module, None, frontend, (), signature, specialization)
    graph.together = tuple(g for g in orders.together if not set(g) & set(attrs))
    return graph


def _is_tensor_attr(graph_module: fx.GraphModule, node: fx.Node) -> bool:
    value: Any = graph_module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return isinstance(value, torch.Tensor)


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__qualname__", None) or getattr(node.target, "__name__", str(node.target))


def _owner(node: fx.Node) -> str:
    """The dotted path of the module whose forward issued ``node``."""
    if node.op == "call_module":
        path = str(node.target)
        return path.rsplit(".", 1)[0] if "." in path else ""
    # export records hooks of its own in the stack (_empty_nn_module_stack_from_metadata_hook)
    paths = [str(path) for path, _cls in (node.meta.get("nn_module_stack") or {}).values()
             if not str(path).startswith("_")]
    if not paths:
        return ""
    path = paths[-1]
    # export names paths like "L['self'].layers[0]" in some versions; keep the dotted module path
    return path.replace("L['self'].", "").replace("L['self']", "")


def _record_graph_calls(graph: OpGraph, args: tuple, kwargs: dict) -> Iterator[RecordedCall]:
    assert graph.graph_module is not None
    gm = graph.graph_module
    values = iter(graph.bind(args, kwargs))
    env: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            return
        if node.op == "get_attr":
            env[node.name] = AttrFetch(gm, str(node.target))()
            continue
        op = graph[node.name]
        module = None
        if node.op == "placeholder":
            value = next(values)
            fn: Callable[..., Any] = identity
            call_args: tuple = (value,)
            call_kwargs: dict = {}
        else:
            call_args = fx.node.map_arg(node.args, lambda n: env[n.name])
            call_kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
            fn, module = node_callable(gm, node)
            value = fn(*call_args, **call_kwargs)
        env[node.name] = value
        state = tuple((name, AttrFetch(gm, name)()) for name in op.state)
        yield RecordedCall(op, fn, tuple(call_args), dict(call_kwargs), value, module, state)


def node_callable(gm: fx.GraphModule, node: fx.Node) -> tuple[Callable[..., Any], nn.Module | None]:
    """What an fx node of ``gm`` calls, and the module it calls (``None`` for a function or method)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return module, module
    if node.op == "call_function":
        return node.target, None
    if node.op == "call_method":
        return MethodCall(node.target), None
    raise RuntimeError(f"fx node {node.name} of kind {node.op} calls nothing")  # pragma: no cover


def identity(value: Any) -> Any:
    return value


class MethodCall:
    """Calls a tensor method by name, e.g. ``x.view(...)``; picklable and printable."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.method)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<method {self.method}>"


class AttrFetch:
    """Fetches a parameter or buffer by dotted path (an fx ``get_attr`` node)."""

    def __init__(self, root: nn.Module, path: str) -> None:
        self.root, self.path = root, path

    def __call__(self) -> Any:
        value: Any = self.root
        for part in self.path.split("."):
            value = getattr(value, part)
        return value
