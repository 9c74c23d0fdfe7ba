"""Stage modules cut out of the captured graph according to a Plan.

Each stage is a ``torch.fx.GraphModule`` whose placeholders are the values entering the stage (its
input cut) and whose output is the tuple of values leaving it (its output cut); a value may be any
pytree of tensors. The modules and tensors the stages use are the original module's own objects,
looked up through its live submodules, so parameters and buffers are shared: the original
``state_dict()`` keys and values never change, buffer updates land in the user's buffers, and an
optimizer built on the original parameters trains the pipeline.

Parameter fetches (fx ``get_attr`` nodes) are re-created in every stage that uses them instead of
being shipped between stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture import OpGraph
from ..capture.devices import retarget_devices
from ..capture.lifted import share_original_modules
from ..capture.mutations import is_in_place, may_alias
from ..capture.pytrees import flatten, unflatten
from ..device import StageStreams, stage_streams
from ..measure.op_clock import OpClock, clocked_module, watching
from ..plans.plan import Plan
from ..torch_private import pytree
from ..weights.initialization import Initializer
from ..weights.materialize import materialize
from .randomness import seed_random_nodes
from .tied_copies import TiedCopies, module_with_leaves


@contextlib.contextmanager
def run_eagerly(stages: Sequence[StageModule]) -> Iterator[None]:
    """``stages`` eager meanwhile, also where they run compiled: the calls outside the steps (the
    check that samples do not depend on each other, the shapes of a batch one sample bigger) run
    without gradients and on other batch sizes, so that compiled they would compile each stage
    twice more, the second time for any batch size, which the steps would then run."""
    before = [stage.eager for stage in stages]
    for stage in stages:
        stage.eager = True
    try:
        yield
    finally:
        for stage, was in zip(stages, before):
            stage.eager = was


class PlanMismatchError(ValueError):
    """The plan was made for another model, or another granularity of the same model."""


@dataclass
class StageModule:
    """One stage ready to run: its module, the names it consumes and produces, and its device."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: torch.device
    mutated: frozenset[int] = frozenset()
    #: where it runs and ships its values (:func:`~lightning_antichain.device.stage_streams`)
    streams: StageStreams = None  # type: ignore[assignment]
    #: the operations that may draw random numbers, each drawing from its own generators
    #: (:mod:`lightning_antichain.stages.randomness`)
    random_nodes: tuple[str, ...] = ()
    #: set while the stage's operations are timed in context (:mod:`~lightning_antichain.measure.op_clock`)
    clock: OpClock | None = None
    #: ``torch.compile``'s arguments where the stage runs compiled (``compile_stages``); ``None``: eager
    compile_arguments: dict[str, Any] | None = None
    #: its operations grouped by block, each group a submodule, where they were
    #: (:mod:`~lightning_antichain.stages.block_units`): FSDP2 shards each block on its own
    block_units: list[Any] = field(default_factory=list)
    #: the stage's graph as it was cut, its operations not grouped: what runs the stage outside the
    #: hooks FSDP2 puts on the groups (finding what crosses its cuts); ``None``: ``module`` is that
    ungrouped: fx.GraphModule | None = None
    #: set while the stage runs outside the steps (:func:`run_eagerly`)
    eager: bool = False

    @property
    def hookless_module(self) -> fx.GraphModule:
        """The stage's graph with no module of its own in between (:attr:`ungrouped`)."""
        return self.ungrouped if self.ungrouped is not None else self.module

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = stage_streams(self.device)

    def __call__(self, leaves: list[Any], spec: Any) -> tuple[list[Any], Any]:
        """Run the stage on the flattened input values; returns its flattened output values."""
        if self.clock is not None:
            with watching(self.clock):
                return flatten(self.clocked_module(*self.arguments(tuple(unflatten(leaves, spec)))))
        module = self.module if self.compile_arguments is None or self.eager else self.compiled_module
        return flatten(module(*self.arguments(tuple(unflatten(leaves, spec)))))

    @cached_property
    def compiled_module(self) -> Callable[..., Any]:
        """The stage's graph through ``torch.compile`` (compiled on its first call, again for a
        micro-batch of shapes its guards do not hold for)."""
        return torch.compile(self.module, **(self.compile_arguments or {}))

    @cached_property
    def clocked_module(self) -> fx.GraphModule:
        """The stage's graph reporting each operation to the clock watching it."""
        return clocked_module(self.module)

    def arguments(self, values: tuple) -> tuple:
        """The values to call the stage with: inputs that the stage changes in place are copied.
        Autograd forbids in-place changes of the leaves that collect input gradients, and the
        micro-batches of one input are views of one tensor: changing one in place would bump the
        version counter they share and fail the backward of the others."""
        if not self.mutated:
            return values
        return tuple(pytree.tree_map(_copy, v) if i in self.mutated else v for i, v in enumerate(values))

    @cached_property
    def trainable(self) -> bool:
        """Whether the stage uses a parameter that needs gradients."""
        return any(p.requires_grad for p in self.parameters())

    def buffers(self) -> list[torch.Tensor]:
        """The buffers this stage fetches directly (those of called modules excluded)."""
        found: dict[int, torch.Tensor] = {}
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                value = _attr(self.module, node.target)
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    found[id(value)] = value
        return list(found.values())

    @cached_property
    def called_modules(self) -> list[nn.Module]:
        """The original modules this stage calls, directly or fetched to call them through a seeded
        call (looked up once: the per-micro-batch paths use it)."""
        found: dict[int, nn.Module] = {}
        for node in self.module.graph.nodes:
            if node.op == "call_module":
                module = self.module.get_submodule(node.target)
            elif node.op == "get_attr" and isinstance(value := _attr(self.module, node.target), nn.Module) and not (
                    isinstance(value, fx.GraphModule)):
                module = value
            else:
                continue
            found.setdefault(id(module), module)
        return list(found.values())

    def submodules(self) -> list[nn.Module]:
        """The original modules this stage calls."""
        return self.called_modules

    def parameters(self) -> list[nn.Parameter]:
        """The original parameters this stage uses, each once: its modules' and those it fetches."""
        found: dict[int, nn.Parameter] = {}
        for module in self.submodules():
            found.update((id(p), p) for p in module.parameters())
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                value = _attr(self.module, node.target)
                if isinstance(value, nn.Parameter):
                    found[id(value)] = value
        return list(found.values())


def _attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in str(target).split("."):
        value = getattr(value, part)
    return value


def split_stages(graph: OpGraph, plan: Plan, devices: list[torch.device]) -> list[StageModule]:
    """One :class:`StageModule` per plan stage, in pipeline order."""
    if graph.graph_module is None:
        raise PlanMismatchError(
            "the pipeline runtime needs an fx-traceable model; this one fell back to top-level children "
            f"({graph.note}). Make it traceable, or keep the untraceable block whole with leaf_modules=[...]."
        )
    gm = graph.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of = plan.stage_of()
    planned = set(stage_of)
    traced = {n for n, node in nodes.items() if node.op not in ("output", "get_attr")}
    if planned != traced:
        missing, unknown = sorted(traced - planned), sorted(planned - traced)
        raise PlanMismatchError(
            f"the plan does not match this model: ops not in the plan {missing[:5]}, plan ops not in the "
            f"model {unknown[:5]}. Plan again for this model (same leaf_modules and granularity)."
        )
    if len(devices) != plan.num_stages:
        raise ValueError(f"got {len(devices)} devices for a plan of {plan.num_stages} stages")
    is_attr = {name for name, node in nodes.items() if node.op == "get_attr"}
    stages = []
    for spec, device in zip(plan.stages, devices):
        members = set(spec.nodes)
        inputs = tuple(n for n in spec.inputs if n not in is_attr)
        outputs = tuple(n for n in spec.outputs if n not in is_attr)
        sub = fx.Graph()
        env: dict[str, fx.Node] = {name: sub.placeholder(name) for name in inputs}
        for node in gm.graph.nodes:
            if node.op in ("output", "placeholder") or node.name not in members or node.name in env:
                continue
            if node.op == "get_attr":
                continue
            for dep in node.all_input_nodes:
                if dep.name not in env:
                    if dep.op != "get_attr":
                        raise PlanMismatchError(
                            f"stage {spec.index} runs {node.name!r} but {dep.name!r} is neither computed "
                            "before it in the stage nor among its inputs; the plan is not convex"
                        )
                    env[dep.name] = sub.get_attr(dep.target)
            env[node.name] = sub.node_copy(node, lambda n, env=env: env[n.name])
        for name in outputs:
            if name not in env and name in is_attr:
                env[name] = sub.get_attr(nodes[name].target)
        sub.output(tuple(_value(env, name) for name in outputs))
        module = share_original_modules(fx.GraphModule(gm, sub, f"Stage{spec.index}"), graph.module)
        retarget_devices(module, graph.capture_device, device)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        mutated = frozenset(i for i, p in enumerate(placeholders) if changed_in_place(module, p))
        random_nodes = tuple(seed_random_nodes(module))
        stages.append(StageModule(spec.index, module, inputs, outputs, device, mutated, random_nodes=random_nodes))
    return stages


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def changed_in_place(module: fx.GraphModule, value: fx.Node) -> bool:
    """Whether an operation may change ``value`` in place, directly or through something that may
    return it or a view of it (``nn.Identity``, dropout in eval mode, ``x.view``, indexing)."""
    seen: set[fx.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_in_place(module, user):
                return True
            if user not in seen and may_alias(module, user):
                seen.add(user)
                stack.append(user)
    return False


def _value(env: dict[str, fx.Node], name: str) -> fx.Node:
    if name not in env:
        raise PlanMismatchError(f"a stage must pass on {name!r} but neither receives nor computes it")
    return env[name]


def place_stages(stages: list[StageModule], initializer: Initializer | None = None,
                 slots: Sequence[Hashable] | None = None, tied: TiedCopies | None = None) -> None:
    """Move each stage's submodules and the tensors it fetches to its device.

    ``slots`` names each stage's device (stages with one name share it; default: their torch
    device). A parameter used by stages on different devices (tied weights, such as a shared
    embedding and output layer) is read through a leaf per device from ``tied``
    (:mod:`.tied_copies`), which sums their gradients into it; without ``tied`` it is refused
    before anything moves. Meta tensors are made real on their stage's device, initialised as
    ``initializer`` says.
    """
    names = list(slots) if slots is not None else [stage.device for stage in stages]
    users: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, stage in enumerate(stages):
        for param in stage.parameters():
            users.setdefault(id(param), []).append(i)
            params[id(param)] = param
    crossing = [key for key, using in users.items() if len({names[i] for i in using}) > 1]
    if crossing and tied is None:
        first, *rest = users[crossing[0]]
        other = next(i for i in rest if names[i] != names[first])
        raise ValueError(
            f"a parameter of shape {tuple(params[crossing[0]].shape)} is used by stage {first} "
            f"({stages[first].device}) and stage {other} ({stages[other].device}): tied parameters across devices "
            "need a leaf per device; put both uses on one device (a fixed balance, or fewer stages)."
        )
    for stage in stages:
        _materialize(stage, initializer)
    for key in crossing:  # each lives where its first stage runs, which reads it without a copy
        _move_in_place(params[key], stages[users[key][0]].device)
    for i, stage in enumerate(stages if crossing else ()):
        assert tied is not None
        mine = {key: tied.leaf(params[key], names[i], stage.device, stages[users[key][0]].streams,
                               at_home=names[i] == names[users[key][0]]) for key in crossing if i in users[key]}
        if mine:
            _read_leaves(stage, mine)
    for stage in stages:
        for module in stage.submodules():
            module.to(stage.device)
        for tensor in [*stage.parameters(), *stage.buffers()]:
            _move_in_place(tensor, stage.device)


def _read_leaves(stage: StageModule, leaves: dict[int, nn.Parameter]) -> None:
    """Make ``stage`` read each parameter keyed in ``leaves`` through its leaf: fetched directly,
    or inside a module it calls (called as a copy of that module holding the leaf)."""
    root = stage.module
    copies: dict[int, str] = {}

    def fresh(kind: str) -> str:
        n = 0
        while hasattr(root, f"_tied_{kind}{n}"):
            n += 1
        return f"_tied_{kind}{n}"

    def module_copy(module: nn.Module) -> str:
        if id(module) not in copies:
            copies[id(module)] = fresh("module")
            root.add_submodule(copies[id(module)], module_with_leaves(module, leaves))
        return copies[id(module)]

    for node in root.graph.nodes:
        if node.op == "get_attr":
            value = _attr(root, node.target)
            if isinstance(value, nn.Parameter) and id(value) in leaves:
                name = fresh("leaf")
                root.register_parameter(name, leaves[id(value)])
                node.target = name
            elif isinstance(value, nn.Module) and not isinstance(value, fx.GraphModule) and any(
                    id(p) in leaves for p in value.parameters()):
                node.target = module_copy(value)
        elif node.op == "call_module":
            module = root.get_submodule(node.target)
            if any(id(p) in leaves for p in module.parameters()):
                node.target = module_copy(module)
    root.recompile()
    for cached in ("called_modules", "trainable", "clocked_module"):
        stage.__dict__.pop(cached, None)


def _materialize(stage: StageModule, initializer: Initializer | None) -> None:
    """Make the parameters and buffers a stage uses that are on the meta device (a model built
    without memory) real on the stage's own device, each owning module initialised or loaded
    (:mod:`~lightning_antichain.weights.materialize`). So a model built on meta is only ever real stage
    by stage, each stage on its device."""
    owners: dict[int, nn.Module] = {}
    for module in stage.submodules():
        owners.update((id(m), m) for m in module.modules())
    for node in stage.module.graph.nodes:
        if node.op == "get_attr" and isinstance(_attr(stage.module, node.target), torch.Tensor):
            owner = stage.module.get_submodule(node.target.rpartition(".")[0])
            owners.setdefault(id(owner), owner)
    materialize(owners.values(), stage.device, "reset", initializer or Initializer(stage.module))


def _move_in_place(tensor: torch.Tensor, device: torch.device) -> None:
    """Move a parameter or buffer without replacing the object, as ``Module.to`` does for parameters:
    optimizers and every stage that fetches it keep seeing the same tensor."""
    if tensor.device == device:
        return
    with torch.no_grad():
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device)
