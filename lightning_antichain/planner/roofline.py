"""What an operation would take on a GPU this machine does not have: its kernels on a roofline.

Every ATen operation an operation dispatches (on meta tensors: shapes, no values) is a kernel of
some kind: a matrix product, attention, an elementwise map, a normalisation or reduction, a copy
or gather, or a view (no kernel). Its FLOPs come from torch's own counter
(``torch.utils.flop_counter``), its bytes from the shapes of what it reads and writes, and its
time from the GPU's dense peak and memory bandwidth (:mod:`.target_devices`), each derated by how
much of it that kind of kernel reaches (:class:`Efficiencies`): the longer of the two, and at
least a kernel's launch. The host issues the kernels ahead of the GPU, so an operation takes the
longer of the GPU's time and the host's time to dispatch them.

Attention through ``scaled_dot_product_attention`` is costed as the fused kernel a GPU runs
(FlashAttention: reads Q, K, V, writes the output, never the score matrix), not as the matrix
products meta tensors decompose it into.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry

from ..capture.pytrees import iter_tensors
from ..torch_private import CONVOLUTION_IMPL, GROUPED_MM, SCALED_MM, OpOverload, TorchDispatchMode
from .target_devices import TargetDevice

KINDS = ("matmul", "attention", "elementwise", "norm", "other")


@dataclass(frozen=True)
class Efficiencies:
    """The share of the GPU's peak each kind of kernel reaches: of the dense FLOP/s (``compute``)
    and of the memory bandwidth (``memory``); a kernel's least time on the GPU (``kernel_s``) and
    the host's time to dispatch one ATen operation in eager mode (``dispatch_s``); where the
    figures came from (``source``)."""

    compute: dict[str, float] = field(default_factory=lambda: {
        "matmul": 0.70, "attention": 0.40, "elementwise": 1.0, "norm": 1.0, "other": 1.0})
    memory: dict[str, float] = field(default_factory=lambda: {
        "matmul": 0.80, "attention": 0.80, "elementwise": 0.80, "norm": 0.65, "other": 0.50})
    kernel_s: float = 3e-6
    dispatch_s: float = 8e-6
    #: the share of a link's bandwidth a ring collective or a send reaches (NCCL's bus bandwidth)
    link: float = 0.85
    #: what a collective costs whatever its bytes
    collective_s: float = 3e-5
    source: str = ("assumed, not fitted: cuBLAS reaches 60-75% of an H100's dense bf16 peak on the matrix "
                   "products of LLM layers, FlashAttention-2 35-45%; eager elementwise kernels 80% of HBM "
                   "bandwidth; about 8 us of host time per eager ATen call; NCCL's rings 85% of a link")

    def __post_init__(self) -> None:
        if not 0 < self.link <= 1:
            raise ValueError(f"efficiencies' link must be a share in (0, 1], got {self.link}")
        for name, table in (("compute", self.compute), ("memory", self.memory)):
            wrong = [k for k, v in table.items() if k not in KINDS or not 0 < v <= 1]
            if wrong or set(table) != set(KINDS):
                raise ValueError(f"efficiencies' {name} must give each of {', '.join(KINDS)} a share in (0, 1]; "
                                 f"got {table}")

    @classmethod
    def load(cls, path: str | Path) -> Efficiencies:
        """Efficiencies saved as JSON (:meth:`save`), e.g. fitted on a GPU."""
        fields = json.loads(Path(path).read_text())
        defaults = cls()
        return cls(**{**dataclasses.asdict(defaults), **fields,
                      "compute": {**defaults.compute, **fields.get("compute", {})},
                      "memory": {**defaults.memory, **fields.get("memory", {})}})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2))


_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
            SCALED_MM, torch.ops.aten.convolution, CONVOLUTION_IMPL,
            torch.ops.aten.convolution_backward, GROUPED_MM}
_NORMS = ("norm", "softmax", "sum", "mean", "var", "std", "amax", "amin", "max", "min", "cumsum", "prod", "logsumexp",
          "argmax", "argmin", "topk", "sort")
_NO_KERNEL = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
              torch.ops.aten.new_empty_strided,
              torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten.alias}


def kind_of(func: OpOverload) -> str | None:
    """The kind of kernel ``func`` runs (:data:`KINDS`), or ``None`` where it runs none (a view,
    a fresh tensor left uninitialised)."""
    packet = func.overloadpacket
    if packet in _NO_KERNEL or _is_view(func):
        return None
    if packet in _MATMULS:
        return "matmul"
    if "attention" in packet.__name__:
        return "attention"
    if torch.Tag.pointwise in func.tags:
        return "elementwise"
    if any(word in packet.__name__ for word in _NORMS):
        return "norm"
    return "other"


def _is_view(func: OpOverload) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _bytes(value: Any) -> int:
    """Bytes a kernel reads or writes for ``value``'s tensors: each tensor's elements, but no more
    than its storage holds (an expanded tensor reads its storage once)."""
    total = 0
    for t in iter_tensors(value):
        nbytes = t.numel() * t.element_size()
        try:
            nbytes = min(nbytes, t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        total += nbytes
    return total


@dataclass(frozen=True)
class Kernel:
    """One kernel as the roofline sees it: its kind (:data:`KINDS`), FLOPs, bytes and dtype."""

    kind: str
    flops: float
    nbytes: float
    dtype: torch.dtype

    def seconds(self, device: TargetDevice, efficiencies: Efficiencies) -> float:
        """Its time on ``device``: the longer of its compute and its memory traffic at the shares
        of the peaks its kind reaches, and at least a kernel's launch."""
        kind = self.kind
        compute = self.flops / (device.peak_flops(self.dtype, kind in ("matmul", "attention"))
                                * efficiencies.compute[kind])
        memory = self.nbytes / (device.hbm_gbps * 1e9 * efficiencies.memory[kind])
        return max(compute, memory, efficiencies.kernel_s)


@dataclass
class Tally:
    """The kernels of what ran under a :class:`RooflineClock`: GPU seconds, host seconds, FLOPs
    and bytes, GPU seconds by kind, and the kernels themselves (to be priced again at other
    efficiencies, as :mod:`.efficiency_fit` does)."""

    gpu_s: float = 0.0
    host_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    by_kind: Counter = field(default_factory=Counter)
    kernels: list[Kernel] = field(default_factory=list)
    #: ATen calls the host dispatched, each :attr:`Efficiencies.dispatch_s`
    dispatches: int = 0

    @property
    def seconds(self) -> float:
        """The operation's time: the GPU's or the host's, whichever is longer (the host issues
        kernels ahead of the GPU, so the two overlap)."""
        return max(self.gpu_s, self.host_s)

    def dispatched(self, efficiencies: Efficiencies) -> None:
        """One more ATen call issued by the host."""
        self.dispatches += 1
        self.host_s += efficiencies.dispatch_s

    def add(self, kind: str, flops: float, nbytes: float, dtype: torch.dtype, device: TargetDevice,
            efficiencies: Efficiencies) -> None:
        kernel = Kernel(kind, flops, nbytes, dtype)
        seconds = kernel.seconds(device, efficiencies)
        self.kernels.append(kernel)
        self.gpu_s += seconds
        self.flops += flops
        self.bytes += nbytes
        self.by_kind[kind] += seconds


class RooflineClock:
    """Runs code on meta tensors and tallies what its kernels would take on ``device``
    (:class:`Tally`, read as :attr:`tally`); usable as a timer of
    :func:`~lightning_antichain.planner.profiler._time_once`."""

    def __init__(self, device: TargetDevice, efficiencies: Efficiencies | None = None) -> None:
        self.device = device
        self.efficiencies = efficiencies or Efficiencies()
        self.tally = Tally()

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """The predicted seconds of ``fn()`` on the target, and what it returned."""
        self.tally = Tally()
        with _Kernels(self), FusedAttention(self):
            result = fn()
        return self.tally.seconds, result

    def kernel(self, kind: str, flops: float, nbytes: float, dtype: torch.dtype) -> None:
        self.tally.add(kind, flops, nbytes, dtype, self.device, self.efficiencies)


class _Kernels(TorchDispatchMode):
    def __init__(self, clock: RooflineClock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.clock.tally.dispatched(self.clock.efficiencies)
        kind = kind_of(func)
        if kind is None:
            return out
        counter = _FLOPS.get(func.overloadpacket) or flop_registry.get(func.overloadpacket)
        flops = counter(*args, **kwargs, out_val=out) if counter is not None else 0
        if kind == "elementwise":
            flops = sum(t.numel() for t in iter_tensors(out))
        dtype = next((t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()), torch.float32)
        nbytes = (0 if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.full)
                  else _bytes((args, kwargs))) + _bytes(out)
        self.clock.kernel(kind, flops, nbytes, dtype)
        return out


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """A grouped matrix product (a mixture of experts' tokens, each group by its expert's matrix):
    every row of ``a`` meets one group's matrix, whichever group it is in, so the FLOPs are those
    of all rows against one matrix (the rows routed to the experts, top-k of each token's)."""
    rows = 1
    for size in a.shape[:-1]:
        rows *= size
    return 2 * rows * a.shape[-1] * b.shape[-1]


#: FLOPs of kernels torch's counter does not count
_FLOPS: dict[Any, Callable[..., int]] = {GROUPED_MM: _grouped_mm_flops}

_ATTENTION = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


class FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on meta as the fused kernel a GPU runs: its output, the
    tensors FlashAttention keeps for backward (Q, K, V, the output and the rows' log-sum-exp),
    and, under a ``clock``, the kernels' costs forward and backward."""

    def __init__(self, clock: RooflineClock | None = None) -> None:
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func not in _ATTENTION or not args[0].is_meta:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        return _Attention.apply(query, key, value, mask, causal, self.clock)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, clock: RooflineClock | None) -> torch.Tensor:
        shape = (*query.shape[:-1], value.shape[-1])
        if query.dim() == 4:  # laid out as (batch, queries, heads, features), as the GPU's kernels write it
            output = query.new_empty((shape[0], shape[2], shape[1], shape[3])).transpose(1, 2)
        else:
            output = query.new_empty(shape)
        rows = query.new_empty(query.shape[:-1], dtype=torch.float32)  # the log-sum-exp of each row's scores
        ctx.save_for_backward(query, key, value, output, rows)
        ctx.clock, ctx.flops = clock, attention_flops(query, key, value, causal)
        ctx.bytes = _bytes((query, key, value, mask, output, rows))
        if clock is not None:
            clock.tally.dispatched(clock.efficiencies)
            clock.kernel("attention", ctx.flops, ctx.bytes, query.dtype)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # recomputes the scores, then four products: 2.5 times the forward's FLOPs; reads the
        # forward's tensors and the output's gradient, writes the three inputs' gradients
        query, key, value, _, _ = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (query, key, value)]
        if ctx.clock is not None:
            ctx.clock.tally.dispatched(ctx.clock.efficiencies)
            ctx.clock.kernel("attention", 2.5 * ctx.flops, ctx.bytes + _bytes((grad, *grads)), grad.dtype)
        return (*grads, None, None, None)


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> float:
    """FLOPs of attention's two products: scores (``Q K^T``) and their weighted sum of ``V``, over
    query heads (grouped-query attention shares K and V, not the work); half under a causal mask."""
    *batch, queries, dim = query.shape
    keys = key.shape[-2]
    heads = 1
    for size in batch:
        heads *= size
    flops = 2.0 * heads * queries * keys * (dim + value.shape[-1])
    return flops / 2 if causal else flops
