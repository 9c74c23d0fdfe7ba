"""Frontend 2: ``torch.export``, non-strict, as torch.distributed.pipelining captures.

It runs ``forward`` with fake tensors, so shape-dependent Python (``b, t = idx.size()``,
``assert t <= block_size``, ``torch.arange(t)``) is fine, and it captures Hugging Face models and timm's
Swin. It keeps the batch dim (dim 0 unless told) of every batched input symbolic where the code
allows (``Dim.AUTO``), and reasons about sizes without assuming they differ from 1, so one graph
serves every micro-batch size in the range export proves (usually all of them). It refuses control
flow on tensor values, since fake tensors have none: ``nn.Transformer`` comparing a mask to a causal
one, ``if x.sum() > 0``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from ..torch_private import FakeTensor, FakeTensorConverter, fx_config, pytree
from .assignments import Assignment, assignments_of, recording_assignments, symbolic_values
from .errors import FrontendRefused, first_line, location_of
from .lifted import rebuild_over_module
from .signature import FlatSignature, original_forward, owner_name
from .specialization import BatchRange, Specialization, input_key


def capture_exported(
    module: nn.Module, args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int] = 0
) -> tuple[fx.GraphModule, FlatSignature, Specialization, tuple[Assignment, ...]]:
    """The exported graph of ``module`` on ``args, kwargs``, over the user's own parameters, and
    the attributes its ``forward`` assigns. ``batch_dim`` (as for the Pipeline) is the dim kept
    symbolic."""
    args, kwargs = FlatSignature.canonical(original_forward(module), args, kwargs)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    shapes = _dynamic_batch(module, args, kwargs, batch_dim)
    traced_args, traced_kwargs = _two_samples(module, args, kwargs, batch_dim)
    try:
        # size-oblivious: prove the graph for every batch size, 1 included, instead of assuming >= 2
        with _quiet("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export"), \
                fx_config.patch(backed_size_oblivious=True), warnings.catch_warnings(), \
                recording_assignments(module, buffers=True) as recording:
            # export warns that tensor attributes were assigned; they are graph outputs here, replayed at run time
            warnings.filterwarnings("ignore", message="The tensor attribute")
            exported = torch.export.export(module, traced_args, traced_kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # export raises many kinds: UserError, GuardOnDataDependentSymNode, ...
        where = location_of(exc)
        raise FrontendRefused(f"{type(exc).__name__}: {first_line(exc)}", location=where) from exc
    if recording.filled_buffers:
        # export then writes the new value into an input instead (torch 2.14); concrete capture is exact
        raise FrontendRefused(f"forward assigns a tensor to {', '.join(recording.filled_buffers)}, a buffer registered "
                              "as None, which torch.export does not capture correctly")
    symbolic = symbolic_values(recording)
    if symbolic:
        raise FrontendRefused(f"forward assigns {', '.join(symbolic)} a size of its input, which torch.export keeps "
                              "symbolic and cannot store")
    _forget_real_tensors(exported.graph_module.graph)
    signature = exported.graph_signature
    state: dict[str, str] = {}
    constants: dict[str, Any] = {}
    user_inputs: list[str] = []
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            state[name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = exported.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        else:
            raise FrontendRefused(f"torch.export lifted an input of kind {spec.kind.name}, which cannot be pipelined")
    if len(user_inputs) != len(leaves):
        raise FrontendRefused(f"torch.export made {len(user_inputs)} inputs of {len(leaves)} argument leaves")
    source = _write_back_mutations(exported.graph_module.graph, signature, state)
    graph_module = rebuild_over_module(source, module, state, constants, exported.graph_module, {},
                                       type(module).__name__)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    ranges = tuple(_batch_range(p, exported.range_constraints) for p in placeholders)
    output = tuple(graph_module.graph.output_node().args[0])
    out_spec = exported.call_spec.out_spec.child(0)
    user, extra = output[:out_spec.num_leaves], output[out_spec.num_leaves:]
    flat = FlatSignature(original_forward(module), in_spec, out_spec, user, owner_name(module))
    specialization = Specialization(input_key(leaves, ranges), ranges,
                                    lambda a, k: capture_exported(module, a, k, batch_dim)[:3])
    assignments = assignments_of(recording, extra, {p.name for p in placeholders})
    return graph_module, flat, specialization, assignments


def _forget_real_tensors(graph: fx.Graph) -> None:
    """Drop what export's fake mode remembers of the real tensors it was called with.

    The fake values the graph keeps (``node.meta["val"]``) hold their fake mode, and its converter
    holds a weak reference to every parameter, buffer and input it saw. A tensor with a weak
    reference cannot be swapped (``torch.utils.swap_tensors``), which is how a model built on meta
    is made real stage by stage; nothing needs the memo once the graph is captured.
    """
    modes = {id(v.fake_mode): v.fake_mode for node in graph.nodes
             for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, FakeTensor)}
    for mode in modes.values():
        old = mode.fake_tensor_converter
        mode.fake_tensor_converter = FakeTensorConverter(copy_data=old.meta_converter.copy_data, export=old.export)


def _two_samples(module: nn.Module, args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int]
                 ) -> tuple[tuple, dict]:
    """The call with a batch of one sample repeated to two. Exported on one sample, a graph keeps
    some sizes at 1 while claiming to hold for larger batches (GPT-2 exported on a micro-batch of 1
    indexed out of bounds on 2); exported on two, it holds for every size, 1 included. Export
    only sees shapes, so the values of the copy do not matter."""
    try:
        bound = inspect.signature(original_forward(module)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    batched: list[tuple[torch.Tensor, int]] = []
    for name, value in bound.arguments.items():
        dim = batch_dim if isinstance(batch_dim, int) else batch_dim.get(name, 0)
        batched += [(t, dim) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not batched or any(t.shape[dim] != 1 for t, dim in batched):
        return args, kwargs
    doubled = {id(t): torch.cat([t, t], dim) for t, dim in batched}
    return pytree.tree_map(lambda v: doubled.get(id(v), v), (args, kwargs))


def _dynamic_batch(module: nn.Module, args: tuple, kwargs: dict, batch_dim: int | Mapping[str, int]
                   ) -> dict[str, Any] | None:
    """Export's ``dynamic_shapes``: the batch dim of every batched tensor left to export
    (``Dim.AUTO``), keyed by ``forward``'s parameter names as export binds them (``*args`` get a
    tuple)."""
    try:
        bound = inspect.signature(original_forward(module)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None

    def dynamic(name: str, value: Any) -> Any:
        dim = batch_dim if isinstance(batch_dim, int) else batch_dim.get(name, 0)
        return {dim: Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > dim else None

    return {name: pytree.tree_map(functools.partial(dynamic, name), value) for name, value in bound.arguments.items()}


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Export logs and prints a graph dump when it refuses; the refusal is reported with the plan
    instead. Warnings (``warnings.warn``) still reach the user."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _write_back_mutations(graph: fx.Graph, signature: Any, state: dict[str, str]) -> fx.Graph:
    """Turn mutated-buffer outputs into in-place copies, leaving only the user's outputs.

    Export's training IR mostly mutates buffers in place already; where it returns a new value
    instead, the copy lands it in the user's buffer as eager execution would.
    """
    output_node = graph.output_node()
    results = list(output_node.args[0])
    by_target = {target: name for name, target in state.items()}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    kept = []
    for spec, value in zip(signature.output_specs, results):
        if spec.kind == OutputKind.USER_OUTPUT:
            kept.append(value)
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            target = placeholders[by_target[spec.target]] if spec.kind == OutputKind.BUFFER_MUTATION else (
                placeholders[spec.target])
            with graph.inserting_before(output_node):
                graph.call_function(torch.ops.aten.copy_.default, (target, value))
        else:
            raise FrontendRefused(
                f"torch.export returned an output of kind {spec.kind.name}, which cannot be pipelined"
            )
    output_node.args = (tuple(kept),)
    return graph


def _batch_range(placeholder: fx.Node, ranges: dict[Any, Any]) -> BatchRange | None:
    value = placeholder.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    dim = next((d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt)), None)
    if dim is None:
        return None
    bounds = ranges.get(value.shape[dim].node.expr)
    if bounds is None:
        return None
    lower, upper = int(bounds.lower), bounds.upper
    try:
        return dim, lower, int(upper)
    except (TypeError, ValueError, AttributeError):  # sympy's infinities
        return dim, lower, None
