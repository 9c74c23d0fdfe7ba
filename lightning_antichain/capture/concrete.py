"""Frontend 3: concrete capture, which runs ``forward`` on the real example and records every ATen op.

Where torch.export has only fake tensors, this has values, so code that decides on them can be
captured: ``nn.Transformer`` comparing a mask with a causal one, a check on a buffer's flag. Each
such read of a tensor's value is a *specialisation*: the graph keeps the branch the example took.
Every one becomes a guard in the graph that recomputes the value at run time and raises
:class:`SpecializationError` if it changed, so a stale specialisation can never change a result. A
read of the batch's own values (``if x.sum() > 0``) would change from batch to batch; it is refused
with the file and line, since the graph could not be trusted for the next batch.

All shapes are specialised too: the runtime captures again for each new micro-batch shape.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from ..device import rng_forked
from ..torch_private import OpOverload, pytree
from .assignments import Assignment, assignments_of, recording_assignments
from .errors import FrontendRefused, first_line, location_of, user_frame
from .isolation import buffers_restored, side_effects_undone
from .lifted import input_placeholder_names, rebuild_over_module
from .signature import FlatSignature, original_forward, owner_name
from .specialization import Specialization, input_key


class SpecializationError(RuntimeError):
    """A value the graph was specialised on at capture has changed; the graph no longer holds."""


def check_specialized(value: Any, expected: Any, where: str) -> None:
    """The guard: ``value`` computed now must equal ``expected`` seen at capture."""
    if value != expected:
        raise SpecializationError(
            f"the captured graph assumed a value of {expected!r} here, but it is now {value!r}: {where}. "
            "The pipeline captured forward on an example and kept the branch that example took. Keep the "
            "module holding this code whole with leaf_modules=[...], so it runs as written."
        )


torch.fx.wrap("check_specialized")


def capture_concrete(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[fx.GraphModule, FlatSignature, Specialization, tuple[Assignment, ...]]:
    """The ATen graph of one real run of ``module`` on ``args, kwargs``, with guards on value reads,
    and the attributes its ``forward`` assigns."""
    args, kwargs = FlatSignature.canonical(original_forward(module), args, kwargs)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    inputs = (args, kwargs)

    def run(state: dict[str, torch.Tensor], inputs: tuple[tuple, dict]) -> Any:
        return functional_call(module, state, inputs[0], inputs[1])

    try:
        with side_effects_undone(module), recording_assignments(module, buffers=True) as recording:
            traced = make_fx(run, tracing_mode="real", pre_dispatch=True, record_stack_traces=True,
                             _error_on_data_dependent_ops=False)(state, inputs)
    except Exception as exc:  # whatever the user's forward raises on this input
        raise FrontendRefused(f"{type(exc).__name__}: {first_line(exc)}", location=location_of(exc)) from exc
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    state_names = list(state)
    with_paths, in_spec = pytree.tree_flatten_with_path(inputs)
    leaves = [v for _, v in with_paths]
    if len(placeholders) != len(state_names) + len(leaves):
        raise FrontendRefused(
            f"make_fx made {len(placeholders)} inputs for {len(state)} tensors and {len(leaves)} leaves"
        )
    state_map = {p.name: q for p, q in zip(placeholders, state_names)}
    names = input_placeholder_names([pytree.keystr(path) for path, _ in with_paths])
    input_names = {p.name: n for p, n in zip(placeholders[len(state_names):], names)}
    _guard_value_reads(traced, set(input_names), (state, inputs))
    graph_module = rebuild_over_module(traced.graph, module, state_map, {}, traced, input_names, type(module).__name__)
    output = tuple(graph_module.graph.output_node().args[0])
    out_spec = traced._out_spec.child(0)
    user, extra = output[:out_spec.num_leaves], output[out_spec.num_leaves:]
    flat = FlatSignature(original_forward(module), in_spec, out_spec, user, owner_name(module))
    ranges = tuple(None for _ in leaves)
    specialization = Specialization(input_key(leaves, ranges), ranges,
                                    lambda a, k: capture_concrete(module, a, k)[:3])
    assignments = assignments_of(recording, extra, set(input_names.values()))
    return graph_module, flat, specialization, assignments


def _is_value_read(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, OpOverload) and (
        torch.Tag.data_dependent_output in target.tags
    )


def _guard_value_reads(traced: fx.GraphModule, user_inputs: set[str], example: Any) -> None:
    """Refuse reads of the batch's values; guard every other read with its value at capture."""
    reads = [n for n in traced.graph.nodes if _is_value_read(n)]
    if not reads:
        return
    for node in reads:
        ancestors = _ancestors(node)
        if any(a.op == "placeholder" and a.name in user_inputs for a in ancestors):
            where = _where(node)
            raise FrontendRefused(
                f"forward decides on the values of its input ({node.target} at {where}); that decision can "
                "differ from batch to batch, so no fixed graph is correct",
                location=where,
                data_dependent=True,
            )
    values = _values_of(traced, reads, example)
    for node in reads:
        with traced.graph.inserting_after(node):
            traced.graph.call_function(check_specialized, (node, values[node], _where(node)))
    traced.recompile()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _values_of(traced: fx.GraphModule, reads: list[fx.Node], example: Any) -> dict[fx.Node, Any]:
    """The value each read returned on the example: the graph run once more, side effects undone."""
    wanted = set(reads)
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n in wanted:
                values[n] = result
            return result

    state, _ = example
    with buffers_restored(state), rng_forked(example), torch.no_grad():
        Recorder(traced).run(*pytree.tree_leaves(example))
    return values


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = _parse_stack(trace)
    return user_frame(frames) or (frames[-1].filename + f":{frames[-1].lineno}" if frames else str(node.target))


def _parse_stack(text: str) -> list[traceback.FrameSummary]:
    """The frames of an fx node's recorded stack trace (``File "...", line N, in f`` + code)."""
    frames = []
    lines = text.strip().splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            filename = line.split('"')[1]
            try:
                lineno = int(line.split("line ")[1].split(",")[0])
            except (IndexError, ValueError):
                continue
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File") else ""
            frames.append(traceback.FrameSummary(filename, lineno, "", line=code))
    return frames
