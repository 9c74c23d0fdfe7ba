"""How a call of the captured module maps onto its graph's placeholders, and the graph's outputs back.

fx keeps ``forward``'s own parameters as placeholders (:class:`FxSignature`); torch.export and
concrete capture flatten the call's arguments into tensor and constant leaves with
``torch.utils._pytree`` (:class:`FlatSignature`). Both give the runtime the same two operations:
``bind`` a call to the list of placeholder values, and ``assemble`` the module's return value from
the values of the graph's output nodes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from ..torch_private import pytree


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Lightning's ``example_input_array`` convention: tuple = positional, dict = keyword, else one arg."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return (example_inputs,), {}


class SignatureMismatchError(TypeError):
    """A call does not have the structure of the call the graph was captured from."""


class FxSignature:
    """``forward``'s parameters are the placeholders; defaults are filled in by name."""

    def __init__(self, graph_module: fx.GraphModule, owner: str) -> None:
        self.placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self.output = graph_module.graph.output_node().args[0]
        self.owner = owner

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        bound = bind_placeholders(self.placeholders, args, kwargs, self.owner)
        return [bound[n.name] for n in self.placeholders]

    def unbind(self, values: list[Any]) -> tuple[tuple, dict]:
        return tuple(values), {}

    def assemble(self, by_name: dict[str, Any]) -> Any:
        return fx.node.map_arg(self.output, lambda n: by_name[n.name])


class FlatSignature:
    """The call's arguments, named as ``forward`` names them, flattened into pytree leaves.

    Calls are first put in one canonical form (every argument by name, unless ``forward`` takes
    ``*args``), so ``model(x)`` and ``model(x=x)`` bind alike.
    """

    def __init__(self, forward: Callable[..., Any], in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                 output: Any, owner: str) -> None:
        self.forward = forward
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.output = output
        self.owner = owner

    @staticmethod
    def canonical(forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every argument passed by name where ``forward`` allows it."""
        try:
            signature = inspect.signature(forward)
        except (TypeError, ValueError):
            return args, kwargs
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
            return args, kwargs
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SignatureMismatchError(f"{exc}") from None
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        return (), named

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        leaves, spec = pytree.tree_flatten(self.canonical(self.forward, args, kwargs))
        if spec != self.in_spec:
            raise SignatureMismatchError(
                f"{self.owner}() was captured for calls shaped like {_describe(self.in_spec)} and is now called "
                f"with {_describe(spec)}. Call it the same way each time (the same arguments, the same "
                "nesting), or pipeline a submodule whose calls do not change (module=...)."
            )
        return leaves

    def unbind(self, values: list[Any]) -> tuple[tuple, dict]:
        args, kwargs = pytree.tree_unflatten(list(values), self.in_spec)
        return tuple(args), dict(kwargs)

    def assemble(self, by_name: dict[str, Any]) -> Any:
        leaves = [by_name[v.name] if isinstance(v, fx.Node) else v for v in self.output]
        return pytree.tree_unflatten(leaves, self.out_spec)


def _describe(spec: pytree.TreeSpec) -> str:
    text = str(spec).replace("\n", " ")
    return " ".join(text.split())


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


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's own ``forward``, even while a strategy has installed another one on the instance."""
    return type(module).forward.__get__(module)


def owner_name(module: nn.Module) -> str:
    return f"{type(module).__name__}.forward"
