"""Profile a model while only a bounded part of it is real on the device at once.

The ordinary profile copies the whole model to the device and records one forward pass with every
value kept. A model built on meta, or too big for the device, is profiled here instead, from a
copy of it on meta:
the graph runs in execution order, each operation's modules are made real on the device just
before it runs (random values of the right shape and dtype, through ``reset_parameters()`` where a
module has one) and sent back to meta after their last use, and each value is dropped after its
last reader. So the device holds at most the live activations of one micro-batch (as a forward
pass without autograd would) and the state of the operations in flight, never the whole model.

Each operation is timed and its saved tensors counted as in the ordinary profile, on the real
values of its inputs (integer tensors, such as positions, keep their meaning), except that it is
timed ``warmup + repeats`` times in a row instead of round-robin over all operations.

A block that repeats an earlier one operation for operation (a decoder's layers,
:mod:`.repeated_blocks`) is not run: each of its operations takes its counterpart's times and
saved tensors, once its inputs are found to have the counterpart's shapes. Its outputs that later
operations read are zeros of the counterpart's shapes.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture import OpGraph, RecordedCall
from ..capture.devices import retarget_devices
from ..capture.mutations import is_in_place
from ..capture.opgraph import AttrFetch, identity, node_callable
from ..capture.pytrees import iter_tensors, map_tensors
from ..device import is_meta, peak_memory_since, start_peak_memory
from ..measure.saved_tensors import CallMemory, SavedLedger, storage_of
from ..weights.materialize import materialize, own_state, release
from .repeated_blocks import Repeat, find_repeats


@dataclass
class StreamedProfile:
    """Per operation, in execution order: its call (values replaced by meta tensors of their shape),
    its timings, and what it keeps for backward; the most bytes the profile held on the device;
    and the blocks measured as repeats of another, by the block they repeat."""

    calls: list[RecordedCall] = field(default_factory=list)
    samples: list[list[tuple[float, float]]] = field(default_factory=list)
    kept: list[CallMemory] = field(default_factory=list)
    peak_bytes: int | None = None
    repeated: dict[str, list[str]] = field(default_factory=dict)


def profile_just_in_time(graph: OpGraph, args: tuple, kwargs: dict, device: torch.device,
                         time_once: Callable[[RecordedCall], tuple[float, float]], rounds: int, warmup: int,
                         step: Callable[[], None], repeats_once: bool = True) -> StreamedProfile:
    """Time and count each operation of ``graph`` (its module on meta) on ``device``, one at a time.

    ``time_once`` times one replay of a call; ``rounds`` replays are made of each, the first
    ``warmup`` not kept; ``step`` reports each replay's progress. ``repeats_once``: blocks that
    repeat an earlier one take its measurements instead of running.
    """
    assert graph.graph_module is not None, "a model on meta is profiled from its captured graph"
    work = meta_copy(graph.graph_module)
    work.train()
    retarget_devices(work, graph.capture_device, device)
    replay = graph.rebound(work, work)
    ledger = SavedLedger(on_meta=is_meta(device))
    run = _JustInTime(replay, work, device, find_repeats(replay, work) if repeats_once else [], ledger.names_of)
    result = StreamedProfile()
    position: dict[str, int] = {}
    start = start_peak_memory(device)
    completed = False
    try:
        for call, like in run.calls(args, kwargs):
            position[call.node.name] = len(result.calls)
            if like is not None:  # an operation of a repeated block: its counterpart's measurements
                measured = list(result.samples[position[like]])
                ledger.add_like(call, like, run.names_like(call.node.name), run.state_storages())
                for _ in range(rounds):
                    step()
            else:
                measured = _timed(call, time_once, rounds, warmup, step)
                ledger.add(call, run.state_storages())
            result.calls.append(_shapes_only(call))
            result.samples.append(measured)
            del call
            run.forget()
            ledger.forget(run.alive_storages())  # stand-ins of a repeated block's values die at once
        completed = True
    finally:
        if completed:
            release(work.modules())
        # else the copy goes with this frame: releasing it now would fail on the references the
        # error's traceback holds, and hide the error

    result.kept = ledger.memories()
    result.peak_bytes = peak_memory_since(device, start)
    result.repeated = run.repeated
    return result


#: seconds of an operation's replays after which one more replay, timed, is enough: a layer of a
#: 400 B model takes seconds a replay on a CPU, where seven replays of each would take the profile
#: past ten minutes, and the noise of a replay that long is small
LONG_OP_S = 1.0


def _timed(call: RecordedCall, time_once: Callable[[RecordedCall], tuple[float, float]], rounds: int, warmup: int,
           step: Callable[[], None]) -> list[tuple[float, float]]:
    """``rounds`` replays of ``call``, the first ``warmup`` not kept; fewer, where they take long
    (:data:`LONG_OP_S`): then one replay more is timed and kept."""
    measured: list[tuple[float, float]] = []
    spent = 0.0
    for round_index in range(rounds):
        long = spent >= LONG_OP_S
        timing = time_once(call)
        if round_index >= warmup or long:
            measured.append(timing)
        spent += sum(timing)
        step()
        if long:
            for _ in range(rounds - round_index - 1):
                step()
            break
    return measured


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: nothing of a model
    on meta is copied, nor of a real one (its values are not needed for timing)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        stand_in = torch.empty_like(tensor, device="meta")
        is_parameter = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(stand_in, tensor.requires_grad) if is_parameter else stand_in
    return copy.deepcopy(module, memo)


class _JustInTime:
    """Runs a graph module node by node, its state real only around the nodes that use it."""

    def __init__(self, graph: OpGraph, work: fx.GraphModule, device: torch.device, repeats: list[Repeat],
                 storage_names: Callable[[Any], list[str]]) -> None:
        self.graph, self.work, self.device = graph, work, device
        self._storage_names = storage_names  # how the saved-tensor count names a value's storages
        self._repeat_at = {r.block.nodes[0]: r for r in repeats}  # a repeat, by its first node
        self._references = {r.reference.nodes[0]: r.reference for r in repeats}
        self._input_shapes: dict[str, Any] = {}  # a reference block's input shapes, when it ran
        self._input_names: dict[str, list[list[str]]] = {}  # and its inputs' storages' names
        self._like: dict[str, str] = {}  # node of a repeat being taken -> the reference's node
        self._names: dict[str, dict[str, str]] = {}  # node of a repeat -> its block's names -> the reference's
        self._shapes: dict[str, Any] = {}  # reference node -> its output on meta
        nodes = {n.name: n for n in work.graph.nodes}
        self._read_outside = {name for r in repeats for inside in [set(r.block.nodes)] for name in r.block.nodes
                              if any(u.name not in inside for u in nodes[name].users)}
        self._keep_shapes = {name for r in repeats for name in r.reference.nodes}
        #: repeated blocks taken from a reference block, by the reference's name
        self.repeated: dict[str, list[str]] = {}
        self.env = _Values()
        self._nodes = [n for n in work.graph.nodes if n.op != "output"]
        self._needs: dict[str, list[nn.Module]] = {n.name: self._modules_of(n) for n in self._nodes}
        last_module_use: dict[int, int] = {}
        last_value_use: dict[str, int] = {}
        for index, node in enumerate(self._nodes):
            for module in self._needs[node.name]:
                last_module_use[id(module)] = index
            for source in node.all_input_nodes:
                last_value_use[source.name] = index
        self._release_after: dict[int, list[nn.Module]] = {}
        for module in {id(m): m for n in self._nodes for m in self._needs[n.name]}.values():
            self._release_after.setdefault(last_module_use[id(module)], []).append(module)
        self._drop_after: dict[int, list[str]] = {}
        returned = {source.name for node in work.graph.nodes if node.op == "output" for source in node.all_input_nodes}
        for index, node in enumerate(self._nodes):
            if node.name not in returned:
                self._drop_after.setdefault(last_value_use.get(node.name, index), []).append(node.name)
        self._done = -1
        self._released: set[int] = set()  # storages of released state that kept values still view
        #: costed on shapes (a target GPU's): the state stays on meta, its storages the same throughout
        self._on_meta = is_meta(device)
        self._meta_state = {storage_of(t)[0] for t in [*work.parameters(), *work.buffers()]} if self._on_meta else None

    def _modules_of(self, node: fx.Node) -> list[nn.Module]:
        """The modules whose own state ``node`` uses: a called module and its children, or the
        owner of each parameter or buffer it fetches."""
        if node.op == "call_module":
            return list(self.work.get_submodule(node.target).modules())
        owners = []
        for source in node.all_input_nodes:
            if source.op == "get_attr" and isinstance(AttrFetch(self.work, str(source.target))(), torch.Tensor):
                owners.append(self.work.get_submodule(str(source.target).rpartition(".")[0]))
        return owners

    def calls(self, args: tuple, kwargs: dict) -> Iterator[tuple[RecordedCall, str | None]]:
        """Each node's call on real values, its state made real for it, with ``None``; or, for a
        node of a repeated block, its call with its counterpart's output shapes, not run, with the
        counterpart's name. Values a node was the last to read are dropped, and state it was the
        last to use sent back to meta, by :meth:`forget`."""
        values = iter(self.graph.bind(*map_tensors(lambda t: t.to(self.device), (args, kwargs))))
        gm = self.work
        for index, node in enumerate(self._nodes):
            if node.op == "get_attr":
                self.env[node.name] = AttrFetch(gm, str(node.target))()
                continue
            if node.name in self._references:
                block = self._references[node.name]
                self._input_shapes[block.name] = self._shapes_of_inputs(block.inputs)
                if self._input_shapes[block.name] is not None:
                    self._input_names[block.name] = [self._storage_names(self.env[i]) for i in block.inputs]
            if node.name in self._repeat_at:
                self._take_if_alike(self._repeat_at[node.name])
            like = self._like.pop(node.name, None)
            if like is not None:
                self._done = index
                yield self._call_like(node, like), like
                continue
            if not self._on_meta:
                materialize(self._needs[node.name], self.device, "random")
            op = self.graph[node.name]
            module = None
            if node.op == "placeholder":
                fn: Callable[..., Any] = identity
                call_args: tuple = (next(values),)
                call_kwargs: dict = {}
            else:
                call_args = fx.node.map_arg(node.args, lambda n: self.env[n.name])
                call_kwargs = fx.node.map_arg(node.kwargs, lambda n: self.env[n.name])
                fn, module = node_callable(gm, node)
            output = self._run(node, fn, call_args, call_kwargs)
            self.env[node.name] = output
            if node.name in self._keep_shapes:
                self._shapes[node.name] = map_tensors(lambda t: t.detach().to("meta").requires_grad_(t.requires_grad),
                                                      output)
            state = tuple((name, AttrFetch(gm, name)()) for name in op.state)
            self._done = index
            yield RecordedCall(op, fn, tuple(call_args), dict(call_kwargs), output, module, state), None
        self.forget()

    def _shapes_of_inputs(self, inputs: list[str]) -> Any:
        if any(name not in self.env for name in inputs):
            return None  # read before it is made: not a block that runs as one piece
        return [map_tensors(lambda t: (tuple(t.shape), t.dtype, t.requires_grad), self.env[name]) for name in inputs]

    def _take_if_alike(self, repeat: Repeat) -> None:
        """Take ``repeat``'s block from its reference where its inputs have the reference's shapes."""
        reference = self._input_shapes.get(repeat.reference.name)
        if reference is None or self._shapes_of_inputs(repeat.block.inputs) != reference:
            return
        names = repeat.node_map()
        for own, ref in zip(repeat.block.inputs, self._input_names[repeat.reference.name]):
            names.update(zip(self._storage_names(self.env[own]), ref))  # an input made in place keeps its maker's name
        self._like.update(zip(repeat.block.nodes, repeat.reference.nodes))
        self._names.update((name, names) for name in repeat.block.nodes)
        self.repeated.setdefault(repeat.reference.name, []).append(repeat.block.name)

    def names_like(self, node: str) -> dict[str, str]:
        """The names of ``node``'s repeated block and its inputs -> its reference's."""
        return self._names.pop(node)

    def _call_like(self, node: fx.Node, like: str) -> RecordedCall:
        """``node``'s call, not run: its output is zeros of ``like``'s output shapes where nodes
        outside its block read it, else those shapes on meta."""
        shapes = self._shapes[like]
        if node.name in self._read_outside:
            shapes = self.env[node.name] = map_tensors(
                lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device).requires_grad_(t.requires_grad),
                shapes)
        fn, module = node_callable(self.work, node)
        op = self.graph[node.name]
        state = tuple((name, AttrFetch(self.work, name)()) for name in op.state)
        return RecordedCall(op, fn, (), {}, shapes, module, state)

    def _run(self, node: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``fn``'s output with its autograd graph cut (so that it holds no earlier value or
        parameter), still marked as needing gradients where it does. An in-place operation runs
        without autograd, since the values it changes are such cut leaves, and its output is
        marked as needing gradients where an input or a parameter does."""
        in_place = node.op != "placeholder" and is_in_place(self.work, node)
        with torch.no_grad() if in_place else torch.enable_grad():
            output = fn(*args, **kwargs)
        needs = in_place and any(t.requires_grad for t in [*iter_tensors((args, kwargs)), *_parameters(fn)])
        return map_tensors(lambda t: _cut(t, needs), output)

    def forget(self) -> None:
        """Drop the values and release the state whose last use has run."""
        index = self._done
        for name in self._drop_after.pop(index, ()):
            self.env.pop(name, None)
        modules = self._release_after.pop(index, ())
        if self._on_meta:
            return
        released = {storage_of(t)[0] for m in modules for t in own_state(m) if not t.is_meta}
        release(modules)
        self._released = (self._released | released) & self.alive_storages()

    def state_storages(self) -> set[int]:
        """The storages of the model's state: real now, or sent back to meta while a kept value
        still views it (a slice of a mask buffer, say)."""
        if self._meta_state is not None:
            return self._meta_state
        real = {storage_of(t)[0] for t in [*self.work.parameters(), *self.work.buffers()] if not t.is_meta}
        return real | self._released

    def alive_storages(self) -> set[int]:
        """The storages of the values still kept."""
        if self._on_meta:  # nothing is made real, so no value's storage is swapped under it
            return self.env.storages()
        return {storage_of(t)[0] for value in self.env.values() for t in iter_tensors(value)}


class _Values(dict):
    """The values kept, by node name, with the storages they hold counted as they come and go
    (asked for after nearly every operation: counting them afresh each time was most of a
    profile on meta). The count is right only where no value's storage is swapped in place, as
    making a module's state real does (:func:`~lightning_antichain.weights.materialize.materialize`)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: Counter[int] = Counter()

    def __setitem__(self, name: str, value: Any) -> None:
        self.pop(name, None)
        super().__setitem__(name, value)
        self._held.update(storage_of(t)[0] for t in iter_tensors(value))

    def pop(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        if name not in self:
            return default
        value = super().pop(name)
        self._held.subtract(storage_of(t)[0] for t in iter_tensors(value))
        return value

    def storages(self) -> set[int]:
        return {key for key, count in self._held.items() if count > 0}


def _cut(tensor: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    cut = tensor.detach()
    if tensor.requires_grad or (needs_grad and (cut.is_floating_point() or cut.is_complex())):
        cut.requires_grad_(True)
    return cut


def _parameters(fn: Any) -> list[torch.Tensor]:
    return list(fn.parameters()) if isinstance(fn, nn.Module) else []


def _shapes_only(call: RecordedCall) -> RecordedCall:
    """``call`` without its values: its output as meta tensors of the same shapes and dtypes."""
    output = map_tensors(lambda t: torch.empty_like(t, device="meta"), call.output)
    return RecordedCall(call.node, call.fn, (), {}, output, call.module, call.state)
