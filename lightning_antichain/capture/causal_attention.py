"""Attention whose mask is causal, called as causal attention.

Hugging Face decoders call ``scaled_dot_product_attention(..., is_causal=True)`` when they run, but
under tracing they build the causal mask as a tensor and pass it as ``attn_mask`` (their masking
code cannot tell a traced shape from a real one). A captured graph so calls attention with a
materialised mask, and the fused CUDA kernels then compute every masked block instead of skipping
it: on an H100 that made GPT-2's attention 1.8x slower than in the plain module, and one stage 8.9%
slower than the module (docs/benchmark-runs.md, "On a GPU").

A mask that the graph computes from shapes alone (no input's values, no parameter or buffer, no
random numbers) is the same for every call with the same shapes. Such attention calls go through
:class:`CausalWhenProven`, which checks the mask once per shape against the causal pattern and,
where it matches, calls attention with ``is_causal=True`` and no mask. The result is the same
function; a mask that is not causal (a sliding window, a prefix) keeps its mask.
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .random_ops import may_draw

_ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
#: calls that read a tensor's shape, dtype or device but not its values
_SHAPE_FUNCTIONS = {
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_stride.int, torch.ops.aten.sym_storage_offset.default, torch.ops.aten.dim.default,
}
_SHAPE_METHODS = {"size", "dim", "numel", "ndimension", "get_device"}
_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda"}


class CausalWhenProven:
    """``attention`` (``scaled_dot_product_attention``) called with a mask computed from shapes
    alone: with ``is_causal=True`` and no mask for the shapes where that mask is the causal one."""

    def __init__(self, attention: Any) -> None:
        self.attention = attention
        self.draws_like = attention  # dropout_p draws as the attention it stands for does
        self.__name__ = getattr(attention, "__name__", "scaled_dot_product_attention")
        self._proven: dict[tuple, bool] = {}
        self._lock = threading.Lock()

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 **rest: Any) -> torch.Tensor:
        if attn_mask is not None and not is_causal and self.causal(query, key, attn_mask):
            attn_mask, is_causal = None, True
        return self.attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              **rest)

    def causal(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether ``mask`` is what ``is_causal=True`` masks, for queries and keys of these shapes
        (checked on the first call with them: one synchronisation per shape). A mask on meta has
        no values to check: where it is square, it is taken for a decoder's causal mask, as the
        plan for a GPU not at hand costs it (:mod:`lightning_antichain.planner.target_profile`);
        the run checks the real mask."""
        if mask.is_meta:
            return mask.shape[-2] == mask.shape[-1] == query.shape[-2] == key.shape[-2]
        shapes = (tuple(query.shape), tuple(key.shape), tuple(mask.shape), mask.dtype, mask.device)
        found = self._proven.get(shapes)
        if found is None:
            found = is_causal_mask(mask, query.shape[-2], key.shape[-2])
            with self._lock:
                self._proven[shapes] = found
        return found

    def __eq__(self, other: object) -> bool:  # the same call, whichever capture made it
        return isinstance(other, CausalWhenProven) and other.attention == self.attention

    def __hash__(self) -> int:
        return hash((CausalWhenProven, self.attention))

    def __repr__(self) -> str:
        return f"CausalWhenProven({self.__name__})"


def is_causal_mask(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether attention under ``mask`` is attention with ``is_causal=True``: a boolean mask that
    keeps exactly the lower triangle, or a float mask that adds 0 there and -inf elsewhere."""
    if mask.dim() < 2 or mask.shape[-2] not in (1, queries) or mask.shape[-1] not in (1, keys):
        return False
    keep = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.is_floating_point():
        return False
    blocked = torch.tensor(float("-inf"), dtype=mask.dtype, device=mask.device)
    return bool((mask == torch.where(keep, torch.zeros((), dtype=mask.dtype, device=mask.device), blocked)).all())


def call_causal_attention(graph_module: fx.GraphModule) -> list[str]:
    """Route the attention calls of ``graph_module`` whose mask comes from shapes alone through
    :class:`CausalWhenProven`, in place; returns their names."""
    rewritten = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _ATTENTION or len(node.args) > len(_POSITIONAL):
            continue
        bound = {**dict(zip(_POSITIONAL, node.args)), **node.kwargs}
        mask = bound.get("attn_mask")
        if not isinstance(mask, fx.Node) or bound.get("is_causal", False) is not False:
            continue
        if not _from_shapes_alone(graph_module, mask):
            continue
        query, key, value = (bound.pop(name) for name in ("query", "key", "value"))
        node.target = CausalWhenProven(node.target)
        node.args = (query, key, value)
        node.kwargs = bound
        rewritten.append(node.name)
    if rewritten:
        graph_module.recompile()
    return rewritten


def _from_shapes_alone(graph_module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s value depends on nothing but the shapes, dtypes and devices of the graph's
    inputs: no input's values, no state, no random numbers, no code the graph does not show."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if _reads_shape_only(current):
            continue
        if current.op in ("placeholder", "get_attr", "call_module") or may_draw(graph_module, current):
            return False
        pending.extend(current.all_input_nodes)
    return True


def _reads_shape_only(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _SHAPE_FUNCTIONS:
        return True
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    return (node.op == "call_function" and node.target in (getattr, operator.attrgetter) and len(node.args) > 1
            and node.args[1] in _SHAPE_ATTRIBUTES)
