"""Capture: from the user's ``forward`` to a graph of operations, by a chain of frontends.

Each frontend is tried in turn; the first that succeeds gives the graph, and the reasons the
earlier ones refused are kept with it (``OpGraph.refused``, and this module's debug log), since
they are expected where a later one captures (fx cannot trace most Hugging Face models):

1. ``"fx"``: ``torch.fx`` symbolic tracing (:mod:`.symbolic`). Shape-generic, module-level ops.
2. ``"export"``: ``torch.export``, non-strict (:mod:`.exported`). ATen ops, dynamic batch dimension.
3. ``"concrete"``: a real run recorded op by op (:mod:`.concrete`), with guards on value reads.
4. ``"leaves"``: fx with the blocks it cannot trace kept whole (:mod:`.leaves`).

The strategy, the CLI, :func:`lightning_antichain.profile` and :class:`lightning_antichain.Pipeline`
all capture through :func:`capture`, and the graph that was profiled is the graph that runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .assignments import AssignmentError, assigned_paths, snapshot
from .autograd_functions import functions_kept_whole, functions_restored
from .causal_attention import call_causal_attention
from .children import children_instead, trace_children
from .concrete import SpecializationError, capture_concrete
from .devices import state_on_meta
from .errors import FrontendRefused, UntraceableModelError, logging_call
from .exported import capture_exported
from .isolation import attributes_restored, own_forward, training_flags
from .kept import attributes_read, merged
from .leaves import capture_with_leaves
from .opgraph import OpGraph, OpNode, RecordedCall, op_graph
from .settle import settle
from .signature import SignatureMismatchError, original_forward
from .status import status
from .symbolic import call_specialization, capture_symbolic, constant_arguments

log = logging.getLogger(__name__)

FRONTENDS = ("fx", "export", "concrete", "leaves")
GRANULARITIES = ("ops", "children")
NEEDS_EXAMPLE = ("export", "concrete")

__all__ = [
    "FRONTENDS",
    "GRANULARITIES",
    "AssignmentError",
    "OpGraph",
    "OpNode",
    "RecordedCall",
    "SignatureMismatchError",
    "SpecializationError",
    "UntraceableModelError",
    "capture",
    "capture_call",
    "children_instead",
    "trace",
]


def capture(
    module: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_modules: Sequence[type | str] = (),
    frontends: Sequence[str] = FRONTENDS,
    progress: bool = False,
    batch_dim: int | Mapping[str, int] = 0,
) -> OpGraph:
    """The graph of operations of ``module``, from the first frontend of ``frontends`` that succeeds.

    ``example_inputs`` is one micro-batch in Lightning's ``example_input_array`` convention (a
    tensor, a tuple of positional arguments, or a dict of keyword arguments); export and concrete
    capture need it. ``leaf_modules`` (classes or dotted paths) are kept whole by fx and by the leaf
    frontend. Raises :class:`UntraceableModelError` with every frontend's reason when none succeeds.
    ``progress`` reports each frontend tried on stderr. ``batch_dim`` (as for the Pipeline) is the
    dim torch.export keeps symbolic.
    """
    from .signature import split_inputs

    call = None if example_inputs is None else split_inputs(example_inputs)
    return _capture(module, call, leaf_modules, frontends, progress, batch_dim)


def trace(
    module: nn.Module,
    example_inputs: Any = None,
    *,
    granularity: str = "ops",
    fallback: str | None = "children",
    leaf_modules: Sequence[type | str] = (),
    frontends: Sequence[str] = FRONTENDS,
    batch_dim: int | Mapping[str, int] = 0,
    progress: bool = False,
) -> OpGraph:
    """Build the :class:`OpGraph` of ``module``.

    ``granularity="ops"`` captures through the chain of ``frontends`` (export and concrete capture
    need ``example_inputs``, one micro-batch). If no frontend succeeds and ``fallback="children"``,
    the top-level children become the nodes, for planning only; with ``fallback=None`` an
    :class:`UntraceableModelError` gives every frontend's reason. ``leaf_modules`` keeps the listed
    module classes or dotted paths whole. ``progress`` reports the capture on stderr.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if fallback not in (None, "children"):
        raise ValueError(f"fallback must be None or 'children', got {fallback!r}")
    if granularity == "ops":
        try:
            return capture(module, example_inputs, leaf_modules=leaf_modules, frontends=frontends,
                           batch_dim=batch_dim, progress=progress)
        except UntraceableModelError as exc:
            if fallback is None:
                raise
            return children_instead(module, example_inputs, exc)
    if example_inputs is None:
        raise ValueError("granularity='children' needs example_inputs to observe the data flow")
    return trace_children(module, example_inputs)


def capture_call(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    leaf_modules: Sequence[type | str] = (),
    frontends: Sequence[str] = FRONTENDS,
    progress: bool = False,
    batch_dim: int | Mapping[str, int] = 0,
) -> OpGraph:
    """:func:`capture` for an example given as a call's positional and keyword arguments."""
    return _capture(module, (args, kwargs), leaf_modules, frontends, progress, batch_dim)


def _capture(
    module: nn.Module,
    call: tuple[tuple, dict] | None,
    leaf_modules: Sequence[type | str],
    frontends: Sequence[str],
    progress: bool = False,
    batch_dim: int | Mapping[str, int] = 0,
) -> OpGraph:
    unknown = [f for f in frontends if f not in FRONTENDS]
    if unknown or not frontends:
        raise ValueError(f"frontends must be a non-empty sequence of {FRONTENDS}, got {list(frontends)}")
    refused: list[str] = []
    data_dependent: FrontendRefused | None = None
    logs = ""
    name = type(module).__name__
    for frontend in frontends:
        if frontend in NEEDS_EXAMPLE and call is None:
            refused.append(f"{frontend}: needs an example input (example_input_array)")
            continue
        started = time.perf_counter()
        _report(progress, f"capturing {name} with {frontend} ...", final=False)
        try:
            # gradients on, as in training: whether an assigned attribute needs them is recorded
            with own_forward(module), attributes_restored(module), torch.enable_grad():
                again = functools.partial(_capture_with, frontend, module, call, leaf_modules, batch_dim)
                graph = again()
                warm_start = None
                if graph.assignments:
                    assert call is not None
                    graph, warm_start = settle(module, call, graph, again)
        except FrontendRefused as exc:
            refused.append(f"{frontend}: {exc.reason}")
            log.debug("capturing %s: %s did not capture it: %s", name, frontend, exc.reason)
            _report(progress, f"capturing {name}: {frontend} does not apply, trying the next", final=False)
            if exc.data_dependent and data_dependent is None:
                data_dependent = exc
            logs = logs or logging_call(exc)
            continue
        if warm_start is not None:
            graph.cache = merged(graph.cache, warm_start())
        if graph.graph_module is not None:
            call_causal_attention(graph.graph_module)
        graph.refused = tuple(refused)
        graph.training = training_flags(module)
        _report(progress, f"lightning-antichain: captured {name} with {frontend}: {len(graph)} operations in "
                          f"{time.perf_counter() - started:.1f} s{tried_first(refused)}")
        return graph
    raise UntraceableModelError(_explain(module, refused, data_dependent, logs), refused)


def tried_first(refused: Sequence[str]) -> str:
    """What the capture line says of the frontends tried before the one that captured: their
    names, and where their reasons are (they are expected, not errors: fx cannot trace most
    Hugging Face models, and export then does)."""
    if not refused:
        return ""
    return f" ({', '.join(r.split(':')[0] for r in refused)} tried first; why: la.trace(...).refused)"


def _report(enabled: bool, line: str, final: bool = True) -> None:
    if enabled:
        status(line if line.startswith("lightning-antichain:") else f"lightning-antichain: {line}", final=final)


def _capture_with(
    frontend: str, module: nn.Module, call: tuple[tuple, dict] | None, leaf_modules: Sequence[type | str],
    batch_dim: int | Mapping[str, int] = 0,
) -> OpGraph:
    from .pytrees import iter_tensors

    if frontend == "fx":
        before = snapshot(module)
        constants = None if call is None else constant_arguments(original_forward(module), *call)
        with functions_kept_whole("fx"):
            graph_module = capture_symbolic(module, leaf_modules, constants)
        _refuse_assignments(module, before)
        again = functools.partial(_capture_again, module, leaf_modules, frontend, batch_dim)
        specialization = call_specialization(graph_module, constants or {}, call, again)
        return op_graph(module, graph_module, "fx", specialization=specialization)
    if frontend == "leaves":
        before = snapshot(module)
        with functions_kept_whole("fx"):
            graph_module, made = capture_with_leaves(module, leaf_modules)
        _refuse_assignments(module, before)
        graph = op_graph(module, graph_module, "leaves")
        graph.note = f"kept whole: {', '.join(made)}" if made else None
        return graph
    assert call is not None
    with state_on_meta(module, call, inputs_too=frontend == "export") as ((args, kwargs), put_back), \
            functions_kept_whole("aten"):
        if frontend == "export":
            graph_module, signature, specialization, assignments = capture_exported(module, args, kwargs, batch_dim)
        else:
            graph_module, signature, specialization, assignments = capture_concrete(module, args, kwargs)
        put_back(graph_module)
        functions_restored(graph_module)
    specialization.recapture = functools.partial(_capture_again, module, leaf_modules, frontend, batch_dim)
    graph = op_graph(module, graph_module, frontend, signature, specialization)
    graph.assignments = assignments
    graph.cache = attributes_read(module, graph_module)
    first = next(iter_tensors((args, kwargs)), None)
    graph.capture_device = str(first.device) if first is not None else None
    return graph


def _capture_again(module: nn.Module, leaf_modules: Sequence[type | str], frontend: str,
                   batch_dim: int | Mapping[str, int], args: tuple, kwargs: dict) -> OpGraph:
    """The same frontend on another call, for inputs a graph was not captured for."""
    return _capture(module, (args, kwargs), leaf_modules, (frontend,), False, batch_dim)


def _refuse_assignments(module: nn.Module, before: dict) -> None:
    assigned = assigned_paths(module, before)
    if assigned:
        raise FrontendRefused(f"forward assigns {', '.join(assigned)}, and an fx graph cannot store attributes "
                              "(torch.export and concrete capture can)")


def _experts_hint(module: nn.Module) -> str:
    """What to change in a Hugging Face mixture of experts whose experts loop over the tokens each
    one was routed (shapes that depend on the routing, so on the batch's values)."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager":
        return ""
    return ('Its experts run with experts_implementation="eager", which loops over the tokens routed to each '
            'expert; build it with experts_implementation="batched_mm" (or "grouped_mm" in float32 or bfloat16), '
            "whose shapes do not depend on the routing. ")


def _explain(module: nn.Module, refused: list[str], data_dependent: FrontendRefused | None, logs: str = "") -> str:
    name = type(module).__name__
    if logs:
        return (
            f"{name}.forward calls self.log at {logs}. Logging records a Python value for the logger, so it cannot be "
            "part of the graph of tensor operations that the pipeline runs, and a pipelined forward runs on "
            "micro-batches anyway. Log from training_step or validation_step, from what forward returns. Each "
            "frontend said:\n  " + "\n  ".join(refused)
        )
    lead = (
        f"{name} has Python control flow on its input's values at {data_dependent.location}, so no fixed "
        "graph of it is correct for every batch. "
        if data_dependent is not None
        else f"no capture frontend could turn {name} into a graph of operations. "
    )
    return (
        lead
        + _experts_hint(module)
        + "Keep the block holding that code whole with leaf_modules=['path.to.block'], or pipeline a submodule "
        "that has none (AntichainPipelineStrategy(module='backbone')). Each frontend said:\n  "
        + "\n  ".join(refused)
    )
