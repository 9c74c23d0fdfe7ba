"""The one device layer: everything that differs between the CPU and an accelerator.

After torchgpipe's ``stream.py``, every other module asks this one and none branches on the device
type. It owns streams and events (a stage's copy stream, the current compute stream, waiting and
``record_stream``), synchronisation, the per-device random generators, device memory, autocast
and the device's name. It imports nothing else of the package, so every layer may use it.

CPU devices have no streams: a copy is a plain ``.to``, waiting is nothing, and every CPU device
shares one machine's cores and memory (:func:`shares_host`), which the planner and calibration
account for.

Moving values between stages: on CUDA the sending stage issues the copy on its own copy stream,
after that stream has waited for the compute that produced the values, and hands the receiver an
event; the receiver's compute stream waits for that event and nothing else. So a copy overlaps the
sender's next micro-batch and the receiver's current one, and the caching allocator is told which
streams use each tensor (``record_stream``) so no memory is reused while a copy is in flight.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .torch_private import pytree

Device = str | torch.device

#: the device kinds autocast can be on; a worker thread re-enters its caller's settings for each
AUTOCAST_KINDS = ("cpu", "cuda")


def as_device(device: Device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def is_accelerator(device: Device) -> bool:
    """Whether ``device`` is a CUDA device (streams, its own memory, a fast link to the others)."""
    return as_device(device).type == "cuda"


def shares_host(device: Device) -> bool:
    """Whether ``device`` is the CPU: its stages share one machine's cores, memory and allocator.

    A plan's stage may name a device torch does not know (a planner's ``DeviceSpec("fast")``): it
    is taken to be a device of its own."""
    try:
        return as_device(device).type == "cpu"
    except RuntimeError:
        return False


def same_device(a: Device, b: Device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the index meant."""
    a, b = as_device(a), as_device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def device_name(device: Device) -> str:
    """What the device is, for cache keys and reports: the GPU's model, else the CPU's."""
    device = as_device(device)
    if is_accelerator(device):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def memory_gb(device: Device, usable: float = 0.9) -> float | None:
    """Usable memory of an accelerator in GB (``usable`` of its total); ``None`` (unlimited) on the CPU."""
    device = as_device(device)
    if not is_accelerator(device):
        return None
    return usable * torch.cuda.get_device_properties(device).total_memory / 1e9


def is_meta(device: Device) -> bool:
    """Whether ``device`` is the meta device: shapes without memory, where nothing runs."""
    return as_device(device).type == "meta"


def start_peak_memory(device: Device) -> int | None:
    """Start counting the accelerator's peak allocation from now; returns the bytes allocated now
    (``None`` on the CPU, which has no allocator of its own to ask)."""
    if not is_accelerator(device):
        return None
    torch.cuda.reset_peak_memory_stats(as_device(device))
    return torch.cuda.memory_allocated(as_device(device))


def peak_memory_since(device: Device, start: int | None) -> int | None:
    """The most bytes allocated on the accelerator since :func:`start_peak_memory`, beyond ``start``."""
    if start is None:
        return None
    return torch.cuda.max_memory_allocated(as_device(device)) - start


# Synchronisation, streams and events


def synchronize(devices: Device | Iterable[Device]) -> None:
    """Wait until the queued work of each accelerator in ``devices`` is done (the CPU's always is)."""
    for device in [devices] if isinstance(devices, (str, torch.device)) else devices:
        if is_accelerator(device):
            torch.cuda.synchronize(as_device(device))


def timed(device: Device, fn: Any) -> tuple[float, Any]:
    """Seconds ``fn()`` costs on ``device``, and what it returned. On the CPU: wall time. On an
    accelerator: the longer of the device's time between two events and the host's time to issue
    the work, since a small operation costs its launch and a large one its kernels (synchronising
    around it instead would charge every operation a round trip no training step pays)."""
    device = as_device(device)
    if not is_accelerator(device):
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    result = fn()
    issued = time.perf_counter() - start
    end.record()
    end.synchronize()
    return max(issued, begin.elapsed_time(end) / 1e3), result


def start_clock(streams: StageStreams) -> Any:
    """A mark on the stage's compute stream where a task starts (``None`` on the CPU, where the
    host's clock is the task's)."""
    if streams.compute is None:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(streams.compute)
    return event


def clock_seconds(begin: Any, end: Any) -> float:
    """Seconds the device spent between two :func:`start_clock` marks, waiting for the second."""
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def mark(device: Device) -> Any:
    """Now, on ``device``'s clock: the host's ``time.perf_counter()`` on the CPU, an event on the
    current stream on an accelerator (the stage's compute stream inside its tasks), so that
    :func:`seconds_between` two marks is the device's time, not the time to launch its work."""
    if not is_accelerator(device):
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(begin: Any, end: Any) -> float:
    """Seconds from mark ``begin`` to mark ``end`` (:func:`mark`), waiting for the device's."""
    if isinstance(begin, float):
        return end - begin
    return clock_seconds(begin, end)


def use_device(device: Device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for this thread (CUDA keeps a current device per thread)."""
    device = as_device(device)
    return torch.cuda.device(device) if is_accelerator(device) else contextlib.nullcontext()


@dataclass
class StageStreams:
    """The streams one stage uses on an accelerator (all ``None`` on the CPU): ``compute`` runs its
    forward and backward, so stages sharing a GPU run side by side; ``send`` issues its outgoing
    copies and ``receive`` is entered for the copies coming in, so a copy between two GPUs waits for
    neither device's compute (PyTorch orders a cross-device copy after both devices' current streams)."""

    device: torch.device
    compute: Any = None
    send: Any = None
    receive: Any = None


def stage_streams(device: Device) -> StageStreams:
    """New streams for a stage on ``device``."""
    device = as_device(device)
    if not is_accelerator(device):
        return StageStreams(device)
    return StageStreams(device, torch.cuda.Stream(device), torch.cuda.Stream(device), torch.cuda.Stream(device))


@contextlib.contextmanager
def computing(streams: StageStreams) -> Iterator[None]:
    """Make the stage's device and compute stream current for the calling thread."""
    with use_device(streams.device), (torch.cuda.stream(streams.compute) if streams.compute is not None
                                      else contextlib.nullcontext()):
        yield


CallerStreams = dict[int, Any]


def caller_streams(devices: Iterable[Device]) -> CallerStreams:
    """The calling thread's current stream on each accelerator of ``devices``: where the values
    handed to the stages were made and where their results are used."""
    indices = {as_device(d).index or 0 for d in devices if is_accelerator(d)}
    return {i: torch.cuda.current_stream(i) for i in sorted(indices)}


def wait_for_caller(streams: StageStreams, caller: CallerStreams) -> None:
    """Order the stage's compute after the caller's work queued so far (its inputs, an optimizer step)."""
    if streams.compute is not None:
        streams.compute.wait_stream(caller[streams.device.index or 0])


def release_to_caller(caller: CallerStreams, stages: Iterable[StageStreams], values: Any = None) -> None:
    """Order the caller's later work after all the stages did, and tell the allocator that the
    caller uses the tensors in ``values`` (made on the stages' streams)."""
    for streams in stages:
        if streams.compute is not None:
            stream = caller[streams.device.index or 0]
            for used in (streams.compute, streams.send, streams.receive):
                stream.wait_stream(used)
    for value in pytree.tree_leaves(values):
        if isinstance(value, torch.Tensor) and is_accelerator(value.device):
            value.record_stream(caller[value.device.index or 0])


def autograd_thread_device(grads: Iterable[Any]) -> torch.device | None:
    """The accelerator whose autograd thread runs a backward node that receives ``grads``, or
    ``None`` when the calling thread runs it. PyTorch runs a node on the thread of the first device
    other than the CPU among its incoming gradients; while that thread waits inside the node, no
    other thread's backward on that device can run, so such work is handed to it instead."""
    for grad in grads:
        if isinstance(grad, torch.Tensor) and grad.device.type != "cpu":
            return grad.device
    return None


def add_gradient(total: torch.Tensor | None, grad: torch.Tensor, home: StageStreams) -> torch.Tensor:
    """``total + grad`` (``grad`` where ``total`` is ``None``) on the ``home`` stage's device and
    compute stream, after the work that made ``grad`` (the calling thread's current stream): a
    tied parameter's gradient, collected from its copies on other devices where it lives."""
    if home.compute is None:
        grad = grad.to(home.device)
        return grad if total is None else total + grad
    if is_accelerator(grad.device):
        home.compute.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(home.compute):
        moved = grad.to(home.device, non_blocking=True)
        if moved is grad:  # made on another stream of this device, read on the home stage's
            grad.record_stream(home.compute)
        return moved if total is None else total + moved


def ship(values: Sequence[Any], source: StageStreams, target: StageStreams) -> tuple[tuple[Any, ...], Any]:
    """Detached copies of ``values`` on the target stage's device, and the event its compute must
    wait for (``None``: ready now). Called by the source stage's worker, inside :func:`computing`."""
    detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
    if source is target:  # the last stage's outputs (first stage's input gradients): the caller waits for all
        return tuple(detached), None
    if source.compute is None and target.compute is None:
        return tuple(v.to(target.device) if isinstance(v, torch.Tensor) else v for v in detached), None
    if source.compute is None:  # host to accelerator: from pinned memory on the receiving side's stream
        with torch.cuda.stream(target.receive):
            moved = tuple(_pinned(v).to(target.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                          for v in detached)
            return moved, _recorded(target.receive)
    if same_device(source.device, target.device):  # stages sharing a GPU: no copy, only an order
        return tuple(detached), _recorded(source.compute)
    source.send.wait_stream(source.compute)
    with torch.cuda.stream(source.send), (torch.cuda.stream(target.receive) if target.receive is not None
                                          else contextlib.nullcontext()):
        moved = []
        for v in detached:
            if isinstance(v, torch.Tensor):
                v.record_stream(source.send)
                v = v.to(target.device, non_blocking=target.compute is not None)  # to the CPU: wait for it
            moved.append(v)
        return tuple(moved), _recorded(source.send) if target.compute is not None else None


def _pinned(value: torch.Tensor) -> torch.Tensor:
    return value if value.device.type != "cpu" or value.is_pinned() else value.pin_memory()


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def arrive(values: Sequence[Any], event: Any, streams: StageStreams, grad_flags: Sequence[bool]) -> tuple[Any, ...]:
    """The shipped values made ready for the stage, inside :func:`computing`; flagged tensors become
    gradient leaves. Values that were not shipped (a micro-batch straight from the caller) are moved here."""
    if streams.compute is not None:
        if event is not None:
            streams.compute.wait_event(event)
        for v in values:
            if isinstance(v, torch.Tensor) and same_device(v.device, streams.device):
                v.record_stream(streams.compute)  # made on another stream, used and freed on this one
    ready = [v.detach().to(streams.device) if isinstance(v, torch.Tensor) else v for v in values]
    return tuple(
        v.requires_grad_(True) if flag and isinstance(v, torch.Tensor) else v for v, flag in zip(ready, grad_flags)
    )


# Random number generators


def has_generator(device: Device) -> bool:
    """Whether ``device`` has generators this package can seed and fork."""
    return as_device(device).type in ("cpu", "cuda")


def default_generator(device: Device) -> torch.Generator:
    """The generator ``torch.manual_seed`` seeds and unseeded random ops on ``device`` draw from."""
    device = as_device(device)
    if is_accelerator(device):
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def generator_states() -> list[torch.Tensor]:
    """The states of the CPU's default generator and of every accelerator's in use: a random draw
    changes one of them."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


@contextlib.contextmanager
def rng_forked(example: Any = None) -> Iterator[None]:
    """Random draws made inside this block do not advance the user's generators: the CPU's, and
    those of the accelerators holding a tensor of ``example`` (with no ``example``: of every
    accelerator already in use)."""
    if example is None:
        indices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    else:
        indices = sorted({t.device.index or 0 for t in pytree.tree_leaves(example)
                          if isinstance(t, torch.Tensor) and is_accelerator(t.device)})
    with torch.random.fork_rng(devices=indices):
        yield


# Numerics


@contextlib.contextmanager
def full_precision_float32() -> Iterator[None]:
    """float32 matmuls and convolutions in full float32 while it lasts, none in TF32 (the default of
    cuDNN's convolutions) or bfloat16: two batch sizes may run a layer by two algorithms, whose
    results differ by the reduced precision's rounding, compounded over the layers."""
    settings = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn,
                torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv]
    saved = [(setting, setting.fp32_precision) for setting in settings if hasattr(setting, "fp32_precision")]
    try:
        for setting, _ in saved:
            setting.fp32_precision = "ieee"
        yield
    finally:
        for setting, precision in saved:
            setting.fp32_precision = precision


# Autocast


def autocast_settings() -> list[tuple[str, torch.dtype]]:
    """The calling thread's autocast: each device kind it is on for, with its dtype."""
    return [(kind, torch.get_autocast_dtype(kind)) for kind in AUTOCAST_KINDS if torch.is_autocast_enabled(kind)]


def autocast_managers(settings: Sequence[tuple[str, torch.dtype]]) -> list[Any]:
    """Context managers that enter the autocast ``settings`` (device kind, dtype) exactly, turning
    off the kinds not listed (a recomputed forward runs inside backward, which is outside autocast
    when Lightning runs it, and must see the forward's settings)."""
    enabled = dict(settings)
    return [torch.autocast(kind, dtype=enabled[kind]) if kind in enabled else torch.autocast(kind, enabled=False)
            for kind in AUTOCAST_KINDS if kind in enabled or torch.is_autocast_enabled(kind)]


def forget_autocast_casts() -> None:
    """Drop this thread's cached autocast casts of the weights. A cast made under ``no_grad`` (a
    forward that will be recomputed) has no autograd history; before torch fixed its cache, a later
    forward with gradients in the same autocast region reused it, and its weights got no gradient."""
    torch.clear_autocast_cache()
