"""Tensors another rank holds: what a rank keeps of them, and what user code meets when it reads one.

With one process per stage a rank holds only its own stages' parameters; the others are on the
meta device, each marked with the rank that trains it. User code that reads every parameter (an L2
penalty over ``self.parameters()``, a hook logging weight norms) then fails inside torch with a
message about meta tensors. :func:`explain_meta_read` adds to such an error which parameter it
read, which rank holds it, and what to do instead. ``torch.equal`` on a meta tensor compares by
identity (:func:`equal_by_identity`), so that code asking whether a parameter is one it already
has (Lightning's ``BaseFinetuning`` adding unfrozen layers to an optimizer) works on every rank.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

import torch
from torch import nn

_HELD_BY = "_antichain_held_by"
"""The attribute of a released tensor that names the rank holding it (kept on the tensor, as a
loaded value is: it goes when the tensor does)."""

_LIBRARY: list[Any] = []
_LOCK = threading.Lock()

_META_ERRORS = ("meta tensor", "meta tensors", "device meta", "on the meta device", "is_meta", "meta device")


def mark_held_by(tensor: torch.Tensor, rank: int) -> None:
    """Say that ``tensor`` (released to meta here) is trained by ``rank``."""
    tensor.__dict__[_HELD_BY] = rank


def held_by(tensor: torch.Tensor) -> int | None:
    """The rank that trains ``tensor``, where this rank released it; ``None`` otherwise."""
    return tensor.__dict__.get(_HELD_BY)


def equal_by_identity() -> None:
    """From now on, ``torch.equal`` with a meta tensor is ``True`` for a tensor and itself and
    ``False`` otherwise (torch has no meta kernel for it: it raises). A meta tensor has no values;
    the same object has the same ones."""
    with _LOCK:
        if _LIBRARY:
            return
        library = torch.library.Library("aten", "IMPL")
        library.impl("equal", lambda a, b: a is b, "Meta")
        _LIBRARY.append(library)


def explain_meta_read(exception: BaseException, module: nn.Module | None) -> None:
    """Where ``exception`` came from reading a parameter another rank holds, say so on it: which
    parameter (the first met in the failing frames), the rank that holds it, and what to do."""
    chain = _chain(exception)
    if module is None or not any(pattern in str(e).lower() for e in chain for pattern in _META_ERRORS):
        return
    names = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta}
    if not names:
        return
    found = next((f for e in chain if (f := _read_in_frames(e, names)) is not None), None)
    elsewhere = [t for t in [*module.parameters(), *module.buffers()] if id(t) in names and held_by(t) is not None]
    if found is None and not elsewhere:
        return
    if found is not None:
        name, tensor = found
        rank = held_by(tensor)
        what = (f"it read {name}, which rank {rank} trains; this rank holds it on the meta device, without values"
                if rank is not None else f"it read {name}, which is on the meta device (not made real yet)")
    else:
        some = ", ".join(f"{names[id(t)]} (rank {held_by(t)})" for t in elsewhere[:3])
        what = (f"{len(elsewhere)} parameters and buffers here are other ranks' and on the meta device, without "
                f"values: "
                f"{some}{', ...' if len(elsewhere) > 3 else ''}")
    note = (f"lightning-antichain: with one process per stage (schedule=...) each rank holds only its own stages' "
            f"parameters, and {what}. Read the whole trained model with trainer.strategy.full_state_dict() (every "
            "rank calls it), compute a value over parameters per rank and reduce it over the ranks "
            "(torch.distributed.all_reduce), or leave out schedule= (the in-process runtime holds every parameter).")
    _add_note(exception, note)


def _chain(exception: BaseException) -> list[BaseException]:
    """``exception`` and those it was raised from or during."""
    chain: list[BaseException] = []
    current: BaseException | None = exception
    while current is not None and all(current is not e for e in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _read_in_frames(exception: BaseException, names: dict[int, str]) -> tuple[str, torch.Tensor] | None:
    """The first meta parameter or buffer of the module found among the locals of the frames the
    exception passed, innermost first."""
    for frame, _ in reversed(list(traceback.walk_tb(exception.__traceback__))):
        for value in frame.f_locals.values():
            if isinstance(value, torch.Tensor) and id(value) in names:
                return names[id(value)], value
    return None


def _add_note(exception: BaseException, note: str) -> None:
    if note in getattr(exception, "__notes__", ()):
        return
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    elif exception.args and isinstance(exception.args[0], str):  # Python 3.10
        exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])
