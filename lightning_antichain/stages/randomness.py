"""Random numbers that do not depend on which thread draws them, and that recomputation draws again.

Stages run on worker threads that share the process's default generators, so what one stage draws
would depend on what the others drew meanwhile, and a forward recomputed for backward
(``recompute=...``) would draw other dropout masks than the forward whose output the loss saw: a
gradient of a different function, silently.

So every operation of a stage graph that may draw random numbers (dropout in any form, ``rand*``,
``bernoulli``, ``multinomial``, RNNs with dropout, attention with ``dropout_p``, and modules whose
code the graph cannot see) is called through :class:`SeededCall` (:func:`seed_random_nodes`).
Inside a micro-batch's :func:`drawing` block it draws from generators of its own, seeded from the
step's seed, the micro-batch index and the operation's name; outside one it runs as written. The
step's seed is drawn once per pipelined call from the caller's default CPU generator
(:func:`step_seed`), so ``seed_everything`` still decides the run.

What follows: a pipelined run's random numbers are not the stream plain training draws, but they
have the same distribution; they are the same for every ``recompute`` mode and for any number of
stages or devices (only the micro-batch count changes them), and the same again under the same seed.

The generators are supplied by a dispatch mode, which is local to the worker thread: an ATen op
that takes ``generator=`` gets one, and ``native_dropout`` (which every CPU dropout comes down to)
draws its mask with ``bernoulli_`` from one. Fused kernels that take no generator (CUDA attention
with ``dropout_p``, cuDNN RNNs with dropout) run with their device's default generator swapped for
the operation's own under a lock: other seeded operations wait for it, but a thread outside the
pipeline drawing from that default generator at the same moment would change what they draw.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture.opgraph import MethodCall
from ..capture.random_ops import OFF_VALUES, function_may_draw, may_draw, module_may_draw
from ..device import default_generator, has_generator
from ..torch_private import OpOverload, TorchDispatchMode, pytree

_local = threading.local()
_swap_lock = threading.Lock()


def step_seed() -> int:
    """A seed for one pipelined call, drawn from the caller's default CPU generator."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


@contextlib.contextmanager
def drawing(seed: int | None, micro_batch: int) -> Iterator[None]:
    """Inside this block, on this thread, seeded operations draw for micro-batch ``micro_batch`` of
    the call seeded ``seed`` (``None``: from the default generators, as written)."""
    previous = getattr(_local, "key", None)
    _local.key = None if seed is None else (seed, micro_batch)
    try:
        yield
    finally:
        _local.key = previous


def seed_of(*parts: object) -> int:
    """A 63-bit seed that depends on every part and on nothing else (not on Python's hash seed)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SeededCall:
    """A graph operation that draws from generators of its own inside a :func:`drawing` block."""

    def __init__(self, call: Callable[..., Any], name: str) -> None:
        self.call = call
        self.name = name
        # fx names the generated code's global after these
        self.__name__ = "seeded_" + "".join(c if c.isalnum() else "_" for c in name)
        self.__module__ = __name__

    # eager under torch.compile (compile_stages): the draws must come from these generators, and
    # dynamo would trace each random operation's call apart, guarding on its name (GPT-2's
    # dropouts went past its recompile limit)
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = getattr(_local, "key", None)
        if key is None:
            return self.call(*args, **kwargs)
        with _OwnGenerators(seed_of(*key, self.name)):
            return self.call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SeededCall({self.name!r})"


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def seed_random_nodes(graph_module: fx.GraphModule) -> list[str]:
    """Route every node of ``graph_module`` that may draw random numbers through :class:`SeededCall`,
    in place; returns their names. ``call_module`` nodes become calls of the fetched module."""
    seeded = []
    graph = graph_module.graph
    for node in list(graph.nodes):
        if isinstance(node.target, SeededCall) or not may_draw(graph_module, node):
            continue
        if node.op == "call_module":
            with graph.inserting_before(node):
                fetch = graph.get_attr(node.target)
            node.args = (fetch, *node.args)
            call: Callable[..., Any] = _call_module
        elif node.op == "call_method":
            call = MethodCall(str(node.target))
        else:
            call = node.target
        node.op = "call_function"
        node.target = SeededCall(call, node.name)
        seeded.append(node.name)
    if seeded:
        graph_module.recompile()
    return seeded


class _OwnGenerators(TorchDispatchMode):
    """Give the random ATen ops of this thread generators seeded from ``seed``, one per device."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None
                or _off_at_run_time(func, args, kwargs)):
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        generator = self._generator(device)
        if generator is None:
            return func(*args, **kwargs)
        if func is torch.ops.aten.native_dropout.default:
            return _native_dropout(*args, generator=generator, **kwargs)
        with_generator = _generator_overload(func)
        if with_generator is not None:
            return with_generator(*args, **{**kwargs, "generator": generator})
        return _with_default_swapped(func, args, kwargs, generator, device)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if device not in self.generators:
            if not has_generator(device):
                return None
            generator = torch.Generator(device)
            generator.manual_seed(seed_of(self.seed, device))
            self.generators[device] = generator
        return self.generators[device]


def _native_dropout(input: torch.Tensor, p: float, train: bool | None, *, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` (the op every CPU dropout comes down to) drawing its mask from
    ``generator``: the output and the mask its backward multiplies by, as the native op returns."""
    if p >= 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p, generator=generator)
    return input * mask * (1.0 / (1 - p)), mask


def _off_at_run_time(func: Any, args: tuple, kwargs: dict) -> bool:
    values = dict(zip((a.name for a in func._schema.arguments), args))
    values.update(kwargs)
    return any(name in values and values[name] == off for name, off in OFF_VALUES.items()
               if not isinstance(values.get(name), torch.Tensor))


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.get_default_device()


@functools.cache
def _generator_overload(func: OpOverload) -> OpOverload | None:
    """``func`` if it takes ``generator=``, else its overload that differs only by taking one."""
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        other_names = [a.name for a in other._schema.arguments]
        if "generator" in other_names and [n for n in other_names if n != "generator"] == names:
            return other
    return None


def _with_default_swapped(func: Any, args: tuple, kwargs: dict, generator: torch.Generator,
                          device: torch.device) -> Any:
    """Run ``func`` with ``device``'s default generator in ``generator``'s state, and keep the state
    it leaves in ``generator``; the lock keeps other seeded operations off the default meanwhile."""
    default = default_generator(device)
    with _swap_lock:
        saved = default.get_state()
        default.set_state(generator.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(default.get_state())
            default.set_state(saved)


__all__ = [
    "SeededCall",
    "drawing",
    "function_may_draw",
    "may_draw",
    "module_may_draw",
    "seed_of",
    "seed_random_nodes",
    "step_seed",
]
