"""What crosses each cut between stages that run as processes, as torch's stages send it.

torch.distributed.pipelining sends tensors only, and learns what it sends from a trial forward on
uninitialised inputs, where an integer tensor crossing a cut (token ids, labels, T5's
relative-position buckets) holds garbage that an embedding or a loss then indexes with. Here every
value crossing a cut is known before the first micro-batch of a shape runs: the stages run once on
fake tensors (torch's ``FakeTensorMode``: shapes and dtypes, no memory, no values), from the first
micro-batch's call (:func:`cut_layouts`). Each cut's values are flattened (``torch.utils._pytree``,
tuples a ``nn.GRU`` returns, dicts, dataclasses): a tensor leaf is sent as it is, a Python number
as a 0-dim tensor, turned back into a number on the other side, and any other leaf (``None``, a
string, a dtype) is not sent but put back as the fake run found it, after checking that the sending
stage made the same (:class:`CutLayout`). torch's stages are given the shapes and dtypes they send
and receive (``input_args``/``output_args``), so they never run a trial forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from ..batches.microbatch import same_value
from ..capture.pytrees import flatten, unflatten
from ..stages.split import StageModule
from ..torch_private import FakeTensorMode, pytree, split_backward

#: Python numbers crossing a cut, by type: the dtype of the 0-dim tensor that carries each
NUMBERS: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}


class CutValueError(TypeError):
    """A value crossing a cut is not what the stages were made for."""


@dataclass(frozen=True)
class Sent:
    """A tensor sent across a cut, described (plain values: a layout travels between ranks)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta").requires_grad_(
            self.requires_grad)


@dataclass(frozen=True)
class CutLayout:
    """The values crossing one cut, as a tuple: how they nest (``spec``), and for each leaf how it
    crosses (``kinds``: ``"tensor"``, a number type's name, or ``"constant"``) and what it is
    (``examples``: the :class:`Sent` tensor that carries it, or the value itself for a constant)."""

    spec: pytree.TreeSpec
    kinds: tuple[str, ...]
    examples: tuple[Any, ...]

    @property
    def sent(self) -> tuple[torch.Tensor, ...]:
        """Meta tensors of what torch sends across the cut, in order."""
        return tuple(e.meta() for kind, e in zip(self.kinds, self.examples) if kind != "constant")

    def pack(self, values: tuple, device: torch.device, where: str) -> tuple[torch.Tensor, ...]:
        """The tensors that carry ``values`` (laid out as ``spec``) across the cut."""
        leaves, spec = flatten(values)
        if spec != self.spec:
            raise CutValueError(f"{where} passes on values nested unlike the first micro-batch's: {spec} where "
                                f"{self.spec} was found. A cut carries values of one structure for every micro-batch.")
        sent = []
        for leaf, kind, example in zip(leaves, self.kinds, self.examples):
            if kind == "tensor":
                sent.append(leaf)
            elif kind == "constant":
                if not same_value(leaf, example):
                    raise CutValueError(
                        f"{where} passes on {leaf!r} where the first micro-batch of this shape gave {example!r}: a "
                        "value crossing a cut that is not a tensor or a number must not change. Cut elsewhere (a "
                        "fixed balance=), or compute it in the stage that reads it.")
            else:
                sent.append(torch.tensor(leaf, dtype=example.dtype, device=device))
        return tuple(sent)

    def unpack(self, sent: Sequence[torch.Tensor]) -> tuple:
        """The values the tensors ``sent`` carry (:meth:`pack`)."""
        received = iter(sent)
        leaves = []
        for kind, example in zip(self.kinds, self.examples):
            if kind == "tensor":
                leaves.append(next(received))
            elif kind == "constant":
                leaves.append(example)
            else:
                leaves.append(_NUMBER_TYPES[kind](next(received).item()))
        return tuple(unflatten(leaves, self.spec))


_NUMBER_TYPES = {kind.__name__: kind for kind in NUMBERS}


def layout_of(values: tuple) -> CutLayout:
    """The :class:`CutLayout` of ``values`` (fake or real tensors)."""
    leaves, spec = flatten(values)
    spec = flatten(unflatten(leaves, spec))[1]  # as a stage's outputs come rebuilt (a torch.Size as a tuple)
    kinds, examples = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            kinds.append("tensor")
            examples.append(Sent(tuple(leaf.shape), tuple(_contiguous_strides(leaf.shape)), leaf.dtype,
                                 leaf.requires_grad))
        elif type(leaf) in NUMBERS:
            kinds.append(type(leaf).__name__)
            examples.append(Sent((), (), NUMBERS[type(leaf)]))
        else:
            kinds.append("constant")
            examples.append(leaf)
    return CutLayout(spec, tuple(kinds), tuple(examples))


@dataclass(frozen=True)
class CutLayouts:
    """What crosses every cut of a plan for one shape of micro-batch (:func:`cut_layouts`)."""

    #: ``[what the first stage takes, what it passes on, ..., what the last returns]``
    cuts: tuple[CutLayout, ...]
    #: the stages whose weights torch's split backward (zero-bubble schedules: input gradients
    #: first, weight gradients later) would leave without a gradient: they back-propagate whole
    whole_backward: frozenset[int] = frozenset()


def cut_layouts(stages: Sequence[StageModule], inputs: tuple, device: torch.device, train: bool,
                splits_backward: bool = False) -> CutLayouts:
    """The layout of every cut of ``stages`` (all of a plan's, in order) for a micro-batch whose
    first stage takes ``inputs``, from one run of every stage on fake tensors on ``device`` (with
    gradients where ``train``; ``splits_backward``: under a schedule that takes input and weight
    gradients apart, which stages it cannot, :func:`weights_missed`). Raises where the stages
    cannot run on fake tensors (an operation that reads values: ``nonzero``, ``.item()``)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    whole: set[int] = set()
    with mode, torch.set_grad_enabled(train):
        values = pytree.tree_map(lambda v: _fake_like(v, device) if isinstance(v, torch.Tensor) else v, tuple(inputs))
        layouts = [layout_of(values)]
        for stage in stages:
            state = {name: _fake_like(t, device) for name, t in _named_state(stage)}
            leaves, spec = flatten(tuple(values))
            outputs = functional_call(stage.hookless_module, state, stage.arguments(tuple(unflatten(leaves, spec))),
                                      tie_weights=True, strict=False)
            if splits_backward and train and stage.index > 0 and weights_missed(leaves, outputs, state.values()):
                whole.add(stage.index)
            values = tuple(outputs)
            layouts.append(layout_of(values))
            # the next stage receives them as torch's stages do: fresh leaves, needing gradients as sent
            values = pytree.tree_map(lambda v: v.detach().requires_grad_(v.requires_grad) if isinstance(
                v, torch.Tensor) else v, values)
    return CutLayouts(tuple(layouts), frozenset(whole))


def weights_missed(inputs: list[Any], outputs: Any, weights: Any) -> bool:
    """Whether torch's split backward would not give a stage's weights their gradients.

    Zero-bubble schedules take a stage's input gradients first and its weight gradients later,
    from the intermediate results where the weights' paths meet the inputs' (torch's
    ``stage_backward_input`` and ``stage_backward_weight``). A weight whose path to the outputs
    meets no input that needs a gradient (the stage's inputs need none; it makes an output from
    weights alone, such as T5's position bias from integer buckets) is in no group, and torch
    never computes its gradient (only the first stage is back-propagated whole); and where a
    weight's groups share part of the graph, the weight pass runs through it twice and fails.
    This runs torch's two passes on the fake run's graph and checks that every weight the outputs
    reach got a gradient."""
    grad_fn_of, construct_reverse_graph, stage_backward_input, stage_backward_weight = split_backward()

    # copies: torch's input pass detaches the outputs in place, and these go on to the next stage
    outputs = [t.clone() for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    weights = [w for w in weights if isinstance(w, torch.Tensor) and w.requires_grad]
    if not outputs or not weights:
        return False
    reverse = construct_reverse_graph([fn for t in outputs if (fn := grad_fn_of(t)) is not None])
    reached = [w for w in weights if grad_fn_of(w) in reverse]
    for w in weights:
        w.grad = None
    try:
        _, groups = stage_backward_input(outputs, [torch.ones_like(t) for t in outputs],
                                         [t for t in inputs if isinstance(t, torch.Tensor)], iter(weights))
        stage_backward_weight(iter(weights), groups)
    except Exception:  # noqa: BLE001 - torch's passes fail on this graph: back-propagate it whole
        return True
    return any(w.grad is None for w in reached)


def registered(layouts: CutLayouts) -> CutLayouts:
    """``layouts``, with the dataclasses their specs nest registered with pytree in this process
    (layouts received from another rank name types this one may not have flattened yet)."""
    pending = [layout.spec for layout in layouts.cuts]
    while pending:
        spec = pending.pop()
        kind = spec.type
        if kind is not None and dataclasses.is_dataclass(kind) and kind not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(kind)
        pending.extend(spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs)
    return layouts


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    """The strides of a contiguous tensor of ``shape``: what is sent is made contiguous first."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _named_state(stage: StageModule) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters and buffers, each once (``functional_call`` ties the other names)."""
    module = stage.hookless_module
    return [*module.named_parameters(), *module.named_buffers()]


def _fake_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``tensor``'s shape, dtype and ``requires_grad`` on ``device`` (called in
    fake mode; ``tensor`` may be real, fake, or on meta)."""
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    if tensor.requires_grad and (fake.is_floating_point() or fake.is_complex()):
        fake.requires_grad_(True)
    return fake
