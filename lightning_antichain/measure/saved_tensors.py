"""Count exactly the memory a forward pass keeps for its backward.

Autograd keeps tensors for backward (a convolution's input, a ReLU's output), and a pipeline stage
also keeps each micro-batch's inputs and outputs until its backward has run. Views and in-place
results share storage, so the count is by storage: a storage counts once, in full, for as long as
anything keeps it. The model's own parameters, buffers and constants are left out; they are not
the micro-batch's.

:class:`HeldMemory` counts live and peak bytes, from what ``torch.autograd.graph.saved_tensors_hooks``
sees (:meth:`HeldMemory.saving`) and from what the runtime keeps on purpose (:meth:`HeldMemory.hold`).
The runtime measures each stage with it; :func:`saved_per_call` tells the profiler what each
operation keeps, so the planner can predict it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..capture.opgraph import identity
from ..capture.pytrees import iter_tensors, map_tensors


def storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """A key for the tensor's storage (shared by its views) and the storage's bytes. On meta, where
    every storage's address is 0, the storage's Python object names it (torch keeps one per
    storage while the storage lives)."""
    try:
        storage = tensor.untyped_storage()
        return id(storage) if tensor.is_meta else storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without storage (subclasses, sparse)
        return id(tensor), tensor.numel() * tensor.element_size()


def state_storages(module: nn.Module) -> set[int]:
    """Storage keys of the module's parameters, buffers and plain tensor attributes (graph constants)."""
    found: set[int] = set()
    for sub in module.modules():
        for value in list(sub._parameters.values()) + list(sub._buffers.values()) + list(vars(sub).values()):
            if isinstance(value, torch.Tensor):
                found.add(storage_of(value)[0])
    return found


class HeldMemory:
    """Bytes a stage keeps for backward: now (``current_bytes``) and at most (``peak_bytes``).

    Thread-safe: saved tensors are released on whichever thread frees the autograd graph.
    """

    def __init__(self, excluded: Iterable[int] = ()) -> None:
        self.excluded = set(excluded)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()
        self._users: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def hold(self, values: Iterable[Any]) -> _Hold:
        """Count the storages of the tensors among ``values`` until the returned token is dropped."""
        return _Hold(self, [self._acquire(v) for v in values if isinstance(v, torch.Tensor)])

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves for backward inside the block, until autograd lets it go.

        Autograd no longer checks a tensor saved through hooks for in-place changes, so the check is
        made here instead, with autograd's own message.
        """
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        return _Packed(tensor, _Hold(self, [self._acquire(tensor)]))

    def _acquire(self, tensor: torch.Tensor) -> int | None:
        key, nbytes = storage_of(tensor)
        if key in self.excluded or nbytes == 0:
            return None
        with self._lock:
            users = self._users.get(key, 0)
            if users == 0:
                self._sizes[key] = nbytes
                self.current_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            self._users[key] = users + 1
        return key

    def _release(self, keys: Sequence[int | None]) -> None:
        with self._lock:
            for key in keys:
                if key is None:
                    continue
                self._users[key] -= 1
                if self._users[key] == 0:
                    del self._users[key]
                    self.current_bytes -= self._sizes.pop(key)


class _Hold:
    """Keeps storages counted in a :class:`HeldMemory` while it lives."""

    def __init__(self, ledger: HeldMemory, keys: list[int | None]) -> None:
        self.ledger, self.keys = ledger, keys

    def __del__(self) -> None:
        self.ledger._release(self.keys)


class _Packed:
    """A saved tensor, its version when saved, and its place in the count.

    It keeps the tensor detached (the same storage and version counter): a node that saves its
    own output (tanh, sigmoid, exp) would otherwise hold, through this object, the output that
    holds the node, a cycle Python's collector cannot see into. A graph whose backward never runs
    (torch's pipelining stages run a trial forward before their first step) then stayed alive for
    good, its storages counted. The backward reads the saved values only; a second-order backward
    through measured saved tensors is not supported."""

    def __init__(self, tensor: torch.Tensor, hold: _Hold) -> None:
        self.tensor, self.hold = tensor.detach(), hold
        self.version = _version(tensor)


def _unpack(packed: _Packed) -> torch.Tensor:
    now = _version(packed.tensor)
    if now != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{packed.tensor.type()} {list(packed.tensor.shape)}] is at version {now}; expected version "
            f"{packed.version} instead."
        )
    return packed.tensor


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return None


@dataclass
class CallMemory:
    """What one operation keeps for backward, as ``{key: bytes}`` over storages.

    ``saved``: the storages its backward keeps; ``storages``: those of its output; ``mutated``: the
    storages it changes in place (a stage copies such an input first, so it keeps both);
    ``owned_saved_bytes``: the bytes of the storages it made that some operation keeps (additive
    over operations, for the planner's fast search).
    """

    saved: dict[str, int]
    storages: dict[str, int]
    mutated: list[str]
    owned_saved_bytes: int


def saved_per_call(calls: Sequence[Any], excluded: set[int]) -> list[CallMemory]:
    """What each recorded call (in execution order) keeps for backward.

    Keys name the call whose output first held the storage (``"conv1"``, ``"split#1"`` for a later
    output storage); a storage made and kept inside a call that is nobody's output is ``"name~0"``.
    So a stage keeps the union of the keys its calls save, plus its input and output storages. A
    model input counts at its own size, not its storage's (the micro-batch is a slice of the batch).
    Each call is replayed on copies of its inputs with the counting hooks, and the copies are traced
    back to the storages they copy. ``excluded`` are the storages of the model's own state.
    """
    ledger = SavedLedger()
    for call in calls:
        ledger.add(call, excluded)
    return ledger.memories()


class SavedLedger:
    """:func:`saved_per_call` one call at a time, for a profiler that frees values as it goes.

    Storage keys are addresses, which the allocator reuses once a storage is freed: :meth:`forget`
    drops those no longer alive, so that a later storage at the same address gets its own name.
    """

    def __init__(self, on_meta: bool = False) -> None:
        #: the values are all on meta (costed from shapes): stand-ins on meta are values too, where
        #: elsewhere they are what a released module left behind, or shapes not run
        self._on_meta = on_meta
        self._owner: dict[int, tuple[str, int]] = {}  # storage key -> (name, bytes)
        self._made_by: dict[str, str] = {}  # name -> the call that made it
        self._kept: dict[str, int] = {}
        self._calls: list[tuple[str, dict[str, int], list[str], dict[str, int]]] = []

    def add(self, call: Any, excluded: set[int]) -> None:
        """Count what ``call`` keeps; ``excluded`` are the storages of the model's state it may use."""
        found: dict[str, int] = {}
        fresh_index = 0
        for tensor in iter_tensors(call.output):
            key, nbytes = storage_of(tensor)
            if key in excluded or nbytes == 0:
                continue
            if key not in self._owner:
                name = call.node.name + (f"#{fresh_index}" if fresh_index else "")
                fresh_index += 1
                size = tensor.numel() * tensor.element_size() if call.node.kind == "placeholder" else nbytes
                self._owner[key] = (name, size)
                self._made_by[name] = call.node.name
            found[self._owner[key][0]] = self._owner[key][1]
        keys, mutated = _replay(call, self._owner, excluded)
        self._kept.update(keys)
        self._made_by.update((name, call.node.name) for name in keys if name not in self._made_by)
        self._calls.append((call.node.name, keys, mutated, found))

    def add_like(self, call: Any, reference: str, names: dict[str, str], excluded: set[int]) -> None:
        """Count ``call`` as keeping what the call of node ``reference`` kept (an operation of a
        repeated block, not run), with the names ``names`` maps from this block to the reference's
        turned back; its output's storages (stand-ins) take the names the reference's had (its own
        name, or the input's that an in-place operation or a view returns)."""
        back = {ref: own for own, ref in names.items()}  # later entries (storages' names) win

        def renamed(key: str) -> str:
            cut = min((i for i in (key.find("#"), key.find("~")) if i >= 0), default=len(key))
            return back.get(key[:cut], key[:cut]) + key[cut:]

        _, keys, mutated, found = next(entry for entry in reversed(self._calls) if entry[0] == reference)
        outputs = list(found)
        for index, tensor in enumerate(t for t in iter_tensors(call.output) if self._on_meta or not t.is_meta):
            key, nbytes = storage_of(tensor)
            if key not in excluded and nbytes and key not in self._owner:
                ref = outputs[index] if index < len(outputs) else None
                name = renamed(ref) if ref is not None else f"{call.node.name}#{index}"
                self._owner[key] = (name, nbytes)
                self._made_by.setdefault(name, renamed(self._made_by.get(ref, reference)) if ref else call.node.name)
        for key in keys:
            self._made_by.setdefault(renamed(key), renamed(self._made_by.get(key, reference)))
        keys = {renamed(k): v for k, v in keys.items()}
        self._kept.update(keys)
        self._calls.append((call.node.name, keys, [renamed(m) for m in mutated],
                            {renamed(k): v for k, v in found.items()}))

    def names_of(self, value: Any) -> list[str]:
        """The names of the storages of ``value``'s tensors that calls made."""
        keys = [storage_of(t)[0] for t in iter_tensors(value) if self._on_meta or not t.is_meta]
        return [self._owner[key][0] for key in keys if key in self._owner]

    def forget(self, alive: set[int]) -> None:
        """Drop the storages not among the keys ``alive``: they were freed."""
        self._owner = {key: value for key, value in self._owner.items() if key in alive}

    def memories(self) -> list[CallMemory]:
        """What each call added so far keeps, in the order they were added."""
        owned = {name: 0 for name, *_ in self._calls}
        for name, size in self._kept.items():
            owned[self._made_by[name]] += size
        return [CallMemory(keys, own, mutated, owned[name]) for name, keys, mutated, own in self._calls]


def _replay(call: Any, owner: dict[int, tuple[str, int]], excluded: set[int]) -> tuple[dict[str, int], list[str]]:
    """What one call's backward keeps and which storages it changes in place, by owner key, from a
    replay on copies of its inputs."""
    if call.node.kind in ("placeholder", "get_attr"):
        return {}, []
    copied: dict[int, int] = {}  # copy's storage -> original's storage
    versions: list[tuple[torch.Tensor, int]] = []

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        grad = value.requires_grad and value.is_floating_point()
        if grad and storage_of(value)[0] in excluded:  # a trained parameter, which no forward changes:
            return value.detach().requires_grad_(True)  # not copied (a 400 B model's embedding is 4 GB)
        twin = value.detach().requires_grad_(grad).clone()  # not a leaf, so in-place operations may run
        copied[storage_of(twin)[0]] = storage_of(value)[0]
        versions.append((twin, twin._version))
        return twin

    args, kwargs = map_tensors(copy, call.args), map_tensors(copy, call.kwargs)
    saved: list[torch.Tensor] = []
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, identity):
        output = call.fn(*args, **kwargs)
    made = {}  # replayed output storage -> the owner of the recorded output's storage
    for recorded, replayed in zip(iter_tensors(call.output), iter_tensors(output)):
        if (key := storage_of(recorded)[0]) in owner:
            made.setdefault(storage_of(replayed)[0], owner[key])
    inside: dict[int, tuple[str, int]] = {}
    found: dict[str, int] = {}
    for tensor in saved:
        key, nbytes = storage_of(tensor)
        key = copied.get(key, key)
        if key in excluded or nbytes == 0:
            continue
        name, size = owner.get(key) or made.get(key) or inside.setdefault(key, (f"{call.node.name}~{len(inside)}",
                                                                               nbytes))
        found[name] = size
    mutated = [owner[copied[storage_of(twin)[0]]][0] for twin, version in versions
               if twin._version != version and copied[storage_of(twin)[0]] in owner]
    return found, list(dict.fromkeys(mutated))
