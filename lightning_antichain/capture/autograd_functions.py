"""Custom autograd Functions kept whole: each ``Function.apply`` becomes one operation that runs
the Function itself, its own forward and its own backward.

Every frontend would otherwise trace through ``apply`` into ``forward``: the graph then holds the
forward's operations and autograd differentiates those, so a hand-written backward (a
gradient-reversal layer, a straight-through estimator, a surrogate gradient, a fused kernel) is
silently replaced by the forward's derivative, and Python decisions inside ``forward`` are frozen
at capture. While a frontend traces, :func:`functions_kept_whole` routes ``apply`` on the tracing
thread:

- under fx, a call on traced values becomes a ``call_function`` node whose target,
  :class:`FunctionCall`, calls ``apply`` when the graph runs;
- under torch.export and concrete capture (ATen graphs), a call goes through one opaque custom
  operator, which the tracers record as one node without looking inside; :func:`functions_restored`
  then points each such node at a :class:`FunctionApply`, which calls ``apply`` with the
  arguments the call was captured with.

A Function handed a callable or a module (``torch.utils.checkpoint``'s reentrant variant) reads
parameters the graph cannot see, so no stage would know it holds them: it is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..torch_private import pytree
from .errors import FrontendRefused

_FUNCTION = torch.autograd.Function
_ORIGINAL_APPLY = _FUNCTION.__dict__["apply"]
_STATE = threading.local()  # per thread: None (not capturing), "fx" or "aten"
_PATCH_LOCK = threading.Lock()
_PATCHED = [0]  # how many captures, on any thread, have the patch installed
_CALLS: dict[int, FunctionApply] = {}  # what the ATen capture's operator calls, by key, while capturing
_KEYS = itertools.count()


class _TensorLeaf:
    """Where a Function's result held a tensor, in the structure kept of it."""

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _TensorLeaf()


def _apply(function: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    return _ORIGINAL_APPLY.__get__(None, function)(*args, **kwargs)


def _name(function: type[torch.autograd.Function]) -> str:
    return f"{function.__qualname__}.apply"


def _refuse_hidden_state(function: type[torch.autograd.Function], leaves: list[Any]) -> None:
    for leaf in leaves:
        if _holds_state(leaf):
            raise FrontendRefused(
                f"{_name(function)} is given {_described(leaf)} to run, whose parameters it reads without taking them "
                "as arguments, so no stage could know it holds them. Keep the module that calls it whole with "
                "leaf_modules=['path.to.module']; for torch.utils.checkpoint, pass use_reentrant=False")


def _holds_state(value: Any, depth: int = 0) -> bool:
    """Whether ``value``, an argument that is not a tensor, reaches a module or a tensor when called:
    it is a module, a method of one, or a function (or ``functools.partial``) closing over one."""
    if isinstance(value, (torch.Tensor, fx.Proxy, type)) or depth > 3:
        return False
    if isinstance(value, nn.Module) or isinstance(getattr(value, "__self__", None), (nn.Module, torch.Tensor)):
        return True
    if isinstance(value, functools.partial):
        return any(_holds_state(v, depth + 1) or isinstance(v, torch.Tensor)
                   for v in (value.func, *value.args, *value.keywords.values()))
    function = getattr(value, "__func__", value)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, (nn.Module, torch.Tensor)) or _holds_state(contents, depth + 1):
            return True
    return False


def _described(value: Any) -> str:
    owner = getattr(value, "__self__", None)
    if owner is not None:
        return f"the method {type(owner).__name__}.{getattr(value, '__name__', '?')}"
    if isinstance(value, nn.Module):
        return f"the module {type(value).__name__}"
    return f"the function {getattr(value, '__qualname__', repr(value))}"


class FunctionCall:
    """An fx graph's call of a custom autograd Function: ``function.apply`` on the node's values
    (the traced arguments, in order) and the other arguments as traced (``spec``, ``constants``,
    ``traced``: which leaves of the arguments the node passes), since an fx node's arguments cannot
    hold any Python value (a function to apply)."""

    def __init__(self, function: type[torch.autograd.Function], spec: pytree.TreeSpec, constants: list[Any],
                 traced: list[bool]) -> None:
        self.function, self.spec, self.constants, self.traced = function, spec, constants, traced
        self.__name__ = self.__qualname__ = f"{function.__qualname__}_apply"
        self.__module__ = function.__module__

    def __call__(self, *values: Any) -> Any:
        given = iter(values)
        leaves = [next(given) if traced else constant for traced, constant in zip(self.traced, self.constants)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return _apply(self.function, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<{_name(self.function)}>"


class FunctionApply:
    """An ATen graph's call of a custom autograd Function, as captured: the graph passes the call's
    tensors and symbolic sizes; the other arguments are the captured ones. Outputs that are not
    tensors were baked into the graph, so each call checks they are still what was captured."""

    def __init__(self, function: type[torch.autograd.Function], spec: pytree.TreeSpec, leaves: list[Any]) -> None:
        self.function = function
        self.spec = spec
        self.kinds = ["tensor" if isinstance(v, torch.Tensor) else "size" if isinstance(v, torch.SymInt) else "value"
                      for v in leaves]
        self.values = [None if k != "value" else v for k, v in zip(self.kinds, leaves)]
        self.outputs: tuple[pytree.TreeSpec, list[Any]] | None = None
        self.__name__ = self.__qualname__ = f"{function.__qualname__}_apply"
        self.__module__ = function.__module__

    def arguments(self, tensors: list[torch.Tensor], sizes: list[int]) -> tuple[tuple, dict]:
        given = {"tensor": iter(tensors), "size": iter(sizes)}
        leaves = [v if k == "value" else next(given[k]) for k, v in zip(self.kinds, self.values)]
        return pytree.tree_unflatten(leaves, self.spec)

    def call(self, tensors: list[torch.Tensor], sizes: list[int]) -> tuple[list[Any], pytree.TreeSpec]:
        """The leaves and structure of the Function's result on these arguments."""
        args, kwargs = self.arguments(tensors, sizes)
        with _state(None):  # a Function applied inside this one's forward runs as it is
            leaves, spec = pytree.tree_flatten(_apply(self.function, *args, **kwargs))
        return leaves, spec

    def traced(self, tensors: list[torch.Tensor], sizes: list[int], fresh: bool) -> list[torch.Tensor]:
        """The tensors of the result, for the opaque operator; what else it holds is kept for the
        graph (``outputs``). ``fresh``: copy every tensor (a fake one is only a shape), else those
        sharing an input's memory (an operator's outputs may not alias its inputs)."""
        leaves, spec = self.call(tensors, sizes)
        self.outputs = (spec, [TENSOR if isinstance(v, torch.Tensor) else v for v in leaves])
        inputs = set() if fresh else {t.untyped_storage().data_ptr() for t in tensors}
        return [v.clone() if fresh or v.untyped_storage().data_ptr() in inputs else v
                for v in leaves if isinstance(v, torch.Tensor)]

    def __call__(self, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        leaves, spec = self.call(tensors, sizes)
        assert self.outputs is not None
        captured_spec, captured = self.outputs
        now = [TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        if spec != captured_spec or now != captured:
            raise RuntimeError(
                f"{_name(self.function)} returned {pytree.tree_unflatten(now, spec)!r} where the "
                f"captured graph has {pytree.tree_unflatten(captured, captured_spec)!r}: a value it returns that is "
                "not a tensor changed since the capture. Keep the module that calls it whole with leaf_modules=[...]")
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    def __repr__(self) -> str:
        return f"<{_name(self.function)}>"


@torch.library.custom_op("lightning_antichain::function_apply", mutates_args=())
def function_apply(key: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """A custom autograd Function's call while an ATen graph is captured: opaque to the tracers."""
    return _CALLS[key].traced(tensors, sizes, fresh=False)


@function_apply.register_fake
def _(key: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return _CALLS[key].traced(tensors, sizes, fresh=True)


def _patched_apply(function: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    mode = getattr(_STATE, "mode", None)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if mode == "fx" and any(isinstance(v, fx.Proxy) for v in leaves):
        _refuse_hidden_state(function, leaves)
        traced = [isinstance(v, fx.Proxy) for v in leaves]
        tracer = next(v for v in leaves if isinstance(v, fx.Proxy)).tracer
        call = FunctionCall(function, spec, [None if t else v for v, t in zip(leaves, traced)], traced)
        return tracer.create_proxy("call_function", call, tuple(v for v, t in zip(leaves, traced) if t), {})
    if mode != "aten":
        return _apply(function, *args, **kwargs)
    _refuse_hidden_state(function, leaves)
    call = FunctionApply(function, spec, leaves)
    key = next(_KEYS)
    _CALLS[key] = call
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    sizes = [v for v in leaves if isinstance(v, torch.SymInt)]
    outputs = iter(torch.ops.lightning_antichain.function_apply(key, tensors, sizes))
    assert call.outputs is not None
    captured_spec, captured = call.outputs
    return pytree.tree_unflatten([next(outputs) if v is TENSOR else v for v in captured], captured_spec)


@contextlib.contextmanager
def _state(mode: str | None) -> Iterator[None]:
    before = getattr(_STATE, "mode", None)
    _STATE.mode = mode
    try:
        yield
    finally:
        _STATE.mode = before


@contextlib.contextmanager
def functions_kept_whole(mode: str) -> Iterator[None]:
    """While this thread traces with a frontend of kind ``mode`` (``"fx"`` or ``"aten"``), each
    custom autograd Function it applies is kept whole (module docstring). Other threads' calls
    (stages running meanwhile) are left alone."""
    with _PATCH_LOCK:
        if _PATCHED[0] == 0:
            _FUNCTION.apply = classmethod(_patched_apply)
        _PATCHED[0] += 1
    try:
        with _state(mode):
            yield
    finally:
        with _PATCH_LOCK:
            _PATCHED[0] -= 1
            if _PATCHED[0] == 0:
                _FUNCTION.apply = _ORIGINAL_APPLY
                if getattr(_STATE, "mode", None) is None:
                    _CALLS.clear()


def functions_restored(graph_module: fx.GraphModule) -> None:
    """Point each node of the opaque operator at the Function call it stands for."""
    changed = False
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.lightning_antichain.function_apply.default:
            key, tensors, sizes = node.args
            node.target = _CALLS[key]
            node.args = (tensors, sizes)
            changed = True
    if changed:
        graph_module.recompile()
