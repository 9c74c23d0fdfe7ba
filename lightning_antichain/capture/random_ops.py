"""Which operations of a captured graph may draw random numbers.

Graph-level knowledge, read by the runtime (:mod:`~lightning_antichain.stages.randomness` seeds
what may draw) and by capture's rewrites (a value made without random numbers, from shapes alone,
is the same on every call with the same shapes).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..torch_private import HigherOrderOperator, OpOverload, OpOverloadPacket, torch_assert

#: torch.nn modules that draw random numbers in training; other torch.nn modules draw none
_RANDOM_MODULES: tuple[type, ...] = (
    nn.modules.dropout._DropoutNd,
    nn.RReLU,
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.FractionalMaxPool2d,
    nn.FractionalMaxPool3d,
)
#: random Python-level functions of torch that have no ATen op of the same name
_RANDOM_FUNCTIONS = {
    "dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "gumbel_softmax", "rrelu",
    "scaled_dot_product_attention", "multi_head_attention_forward", "fractional_max_pool2d",
    "fractional_max_pool3d", "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
}
_DETERMINISTIC_MODULES = ("_operator", "operator", "builtins", "math")
#: arguments that switch a random op off when constant: a probability of 0, or eval mode
OFF_VALUES = {"p": 0, "dropout_p": 0, "dropout": 0, "train": False, "training": False}


def may_draw(root: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` may draw random numbers when it runs."""
    if node.op == "call_module":
        return module_may_draw(root.get_submodule(str(node.target)))
    if node.op == "call_method":
        return _name_may_draw(str(node.target)) and not _switched_off(node, None)
    if node.op == "call_function":
        return function_may_draw(node.target) and not _switched_off(node, node.target)
    return False


def module_may_draw(module: nn.Module) -> bool:
    """A module draws if it or a submodule is a random torch.nn module, or code outside torch.nn
    that the graph cannot see into (a leaf module)."""
    for m in module.modules():
        if isinstance(m, _RANDOM_MODULES):
            if getattr(m, "p", 1) != 0 and getattr(m, "dropout", 1) != 0:
                return True
        elif not type(m).__module__.startswith("torch.nn."):
            return True
    return False


def function_may_draw(fn: Any) -> bool:
    """Whether calling ``fn`` may draw random numbers; unknown code is assumed to. A callable that
    stands for another (``draws_like``) draws as that one does."""
    if getattr(fn, "draws_like", None) is not None:
        return function_may_draw(fn.draws_like)
    if isinstance(fn, OpOverload):
        return torch.Tag.nondeterministic_seeded in fn.tags
    if isinstance(fn, OpOverloadPacket):
        return _packet_may_draw(fn)
    module = getattr(fn, "__module__", None) or ""
    if module in _DETERMINISTIC_MODULES or module.startswith("lightning_antichain.") or fn is torch_assert:
        return False  # our own graph helpers (guards) draw nothing
    if module.startswith("torch") and not isinstance(fn, HigherOrderOperator):
        return _name_may_draw(getattr(fn, "__name__", ""))
    return True


@functools.cache
def _name_may_draw(name: str) -> bool:
    bare = name.rstrip("_")
    if bare in _RANDOM_FUNCTIONS:
        return True
    packet = getattr(torch.ops.aten, bare, None)
    return isinstance(packet, OpOverloadPacket) and _packet_may_draw(packet)


def _packet_may_draw(packet: OpOverloadPacket) -> bool:
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, name).tags for name in packet.overloads())


def _switched_off(node: fx.Node, fn: Any) -> bool:
    """Whether the node's constant arguments switch its randomness off (``p=0``, ``training=False``)."""
    names = _argument_names(fn)
    bound = dict(zip(names, node.args)) if names else {}
    bound.update(node.kwargs)
    return any(name in bound and not isinstance(bound[name], fx.Node) and bound[name] == off
               for name, off in OFF_VALUES.items())


def _argument_names(fn: Any) -> list[str]:
    if isinstance(fn, OpOverload):
        return [a.name for a in fn._schema.arguments]
    if fn is None:
        return []
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
