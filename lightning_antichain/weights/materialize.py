"""Give a model built on the meta device real storage, one module at a time, where it is needed.

A model built under :func:`~lightning_antichain.weights.empty_init.init_empty_weights` (or
``torch.device("meta")``, or Lightning's ``empty_init=True``) has the shapes of its parameters but
no memory. The pipeline makes each stage real on the stage's own device, and the profiler makes
each operation's modules real just long enough to time it, so that no device ever holds the whole
model.

Three rules hold for every tensor made real here:

- **Loaded values win.** A value loaded for a meta tensor (:func:`load_state_dict`,
  :func:`~lightning_antichain.weights.checkpoint_files.load_checkpoint`) waits on the tensor and is
  written last, after every initialisation, whatever the module order.
- **An initialisation fills only what is new.** While a module's ``reset_parameters()`` (or
  ``param_init_fn``, or Hugging Face's ``_init_weights``) runs, the tensors below it that were
  already real (loaded, made real by another stage, buffers made in ``__init__``) are hidden
  behind meta stand-ins, so a parent's reset cannot overwrite them.
- **Nothing is used unfilled.** New floating-point tensors start as NaN, and every new tensor must
  have been written (or replaced) by the end; one that was not is an error naming it.

Tensors are swapped in place (``torch.utils.swap_tensors``) instead of replaced as
``Module.to_empty`` does: an optimizer made on the meta model, and every stage that fetches a
parameter, keep the same objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal, NamedTuple

import torch
from torch import nn

from ..capture.devices import behind_meta_stand_ins, named_state
from .initialization import Initializer

Init = Literal["reset", "random"]

Read = Callable[[], torch.Tensor]
"""Gives a loaded value when it is needed (a tensor in memory, a slice of a memory-mapped file)."""

_LOADED = "_antichain_loaded"
"""The attribute of a meta tensor that holds how to read the value loaded for it. Kept on the
tensor rather than in a table: no weak reference (which would stop the swap), and it goes when the
tensor does."""


class IncompatibleKeys(NamedTuple):
    """What ``Module.load_state_dict`` reports: keys the model has that were not given, and keys
    given that the model does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def wait_for_value(tensor: torch.Tensor, read: Read) -> None:
    """Make ``read()`` the value ``tensor`` (on meta) takes when its stage makes it real."""
    tensor.__dict__[_LOADED] = read


def _loaded(tensor: torch.Tensor) -> Read | None:
    return tensor.__dict__.get(_LOADED)


def load_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
                    ) -> IncompatibleKeys:
    """``module.load_state_dict(state_dict)`` for a module that may be on the meta device.

    Real tensors are loaded now. Each meta tensor keeps its value waiting, and takes it when it is
    made real on its stage's device (:func:`materialize`), after and instead of any initialisation:
    so a checkpoint goes straight into the stages, one tensor at a time, never into a whole model
    first. Load the file with ``torch.load(path, mmap=True)`` and its values stay on disk until then
    (:func:`~lightning_antichain.weights.checkpoint_files.load_checkpoint` does this for you, and
    reads safetensors too). ``strict`` refuses missing and unexpected keys, as torch does; a tied
    weight counts as given when any of its names is.
    """
    return load_lazily(module, {k: (tuple(v.shape), _in_memory(v)) for k, v in state_dict.items()}, strict)


def load_lazily(module: nn.Module, entries: Mapping[str, tuple[tuple[int, ...], Read]], strict: bool = True
                ) -> IncompatibleKeys:
    """:func:`load_state_dict` from ``entries``: each key's shape and how to read its value."""
    own = module.state_dict(keep_vars=True)
    keys = incompatible_keys(module, entries)
    if strict and (keys.missing_keys or keys.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                           f"{keys.missing_keys[:5]}, unexpected keys {keys.unexpected_keys[:5]}")
    for key, (shape, read) in entries.items():
        tensor = own.get(key)
        if tensor is None:
            continue
        if tuple(shape) != tuple(tensor.shape):
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(shape)}, "
                               f"the shape in the current model is {tuple(tensor.shape)}")
        if tensor.is_meta:
            wait_for_value(tensor, read)
        else:
            with torch.no_grad():
                tensor.copy_(read())
    return keys


def incompatible_keys(module: nn.Module, given: Iterable[str]) -> IncompatibleKeys:
    """The model's keys that ``given`` lacks (a tied tensor is given by any of its names) and the
    keys of ``given`` the model does not have."""
    own = module.state_dict(keep_vars=True)
    given = set(given)
    present = {id(own[k]) for k in given if k in own}
    missing = sorted(k for k, t in own.items() if k not in given and id(t) not in present)
    return IncompatibleKeys(missing, sorted(given - set(own)))


def _in_memory(value: torch.Tensor) -> Read:
    return lambda: value


def has_meta_state(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta_attributes(module: nn.Module) -> list[str]:
    """Names of the tensors on the meta device that ``module`` and its children hold as plain
    attributes, not as parameters or buffers (a torchmetrics metric's states): nothing knows how to
    make them real."""
    found = []
    for name, sub in module.named_modules():
        registered = {id(t) for t in own_state(sub)}  # an RNN lists its own parameters again (_flat_weights)
        for attribute, value in vars(sub).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if attribute not in ("_parameters", "_buffers") and any(
                    isinstance(v, torch.Tensor) and v.is_meta and id(v) not in registered for v in values):
                found.append(f"{name}.{attribute}" if name else attribute)
    return found


def own_state(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


class UninitializedTensorError(RuntimeError):
    """A tensor made real from meta that nothing filled: training on it would read garbage."""


def materialize(modules: Iterable[nn.Module], device: torch.device, init: Init = "reset",
                initializer: Initializer | None = None) -> list[nn.Module]:
    """Give the meta tensors each of ``modules`` holds itself storage on ``device``; returns the
    modules that had any.

    ``init="reset"`` fills them with their loaded values where given, and otherwise by the ways
    ``initializer`` knows (``param_init_fn``, Hugging Face's ``_init_weights``,
    ``reset_parameters()``), then checks that every one was filled. ``init="random"`` fills them
    with values of the right kind for timing (small normal floats, zero integers) and calls
    ``reset_parameters()`` where a module has one, for the values that shape a computation (a
    mask, a table of positions) where it rebuilds them.
    """
    modules = list({id(m): m for m in modules}.values())
    fresh: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}  # id -> (owner, name, tensor)
    loaded: dict[int, Read] = {}
    made = []
    for module in modules:
        meta = [(name, t) for _, name, t in named_state(module, recurse=False) if t.is_meta]
        if not meta:
            continue
        made.append(module)
        with weak_references_dropped([module]):
            for name, tensor in meta:
                if id(tensor) in fresh:  # one tensor under two names of one module
                    continue
                read = tensor.__dict__.pop(_LOADED, None)
                real = torch.empty_like(tensor, device=device)
                if init == "random":
                    _fill_for_timing(real)
                elif read is None and (real.is_floating_point() or real.is_complex()):
                    real.fill_(float("nan"))  # what the fill check looks for
                _swap(tensor, real)
                fresh[id(tensor)] = (module, name, tensor)
                if read is not None:
                    loaded[id(tensor)] = read
    if init == "random":
        for module in made:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                with torch.no_grad():
                    reset()
        return made
    initializer = initializer or Initializer(None)
    written = {key: (t._version, t.data_ptr()) for key, (_, _, t) in fresh.items()}
    _initialize(made, fresh, set(fresh) - set(loaded), written, initializer, device)
    with torch.no_grad():
        for key, read in loaded.items():
            tensor = fresh[key][2]
            tensor.copy_(read().to(device=tensor.device, dtype=tensor.dtype))
    unfilled = [(module, name) for key, (module, name, tensor) in fresh.items()
                if key not in loaded and _unfilled(module, name, tensor, written[key])]
    if unfilled:
        raise UninitializedTensorError(_unfilled_message(unfilled, initializer, device))
    return made


def _initialize(made: list[nn.Module], fresh: Mapping[int, tuple[nn.Module, str, torch.Tensor]], empty: set[int],
                written: Mapping[int, tuple[int, int]], initializer: Initializer, device: torch.device) -> None:
    """Run each module's initialisation, children before parents, each seeing only new tensors,
    until the new tensors a module holds itself are filled."""
    if not empty:
        return
    own = {id(m): m for m in made if any(id(t) in empty for t in own_state(m))}
    above: dict[int, nn.Module] = {}
    for module in own.values():
        for ancestor in initializer.ancestors(module):
            if id(ancestor) not in own:
                above[id(ancestor)] = ancestor
    for module in sorted([*own.values(), *above.values()], key=lambda m: -initializer.depth(m)):
        mine = [(name, t) for key, (m, name, t) in fresh.items() if m is module and key in empty]
        ways = initializer.own_ways(module) if id(module) in own else initializer.ancestor_ways(module)
        if id(module) in own and not ways:
            raise UninitializedTensorError(_unfilled_message([(module, n) for n, _ in mine], initializer, device,
                                                             no_way=True))
        for way in ways:
            if mine and not any(_unfilled(module, n, t, written[id(t)]) for n, t in mine):
                break
            with torch.no_grad(), _only_new_visible(module, fresh):
                way.run()


def _unfilled(module: nn.Module, name: str, tensor: torch.Tensor, written: tuple[int, int]) -> bool:
    """Whether nothing wrote ``tensor``, ``module``'s ``name``: still NaN anywhere (floating point,
    so a partial fill counts as unfilled) or never written (other dtypes); a tensor the module
    replaced is filled unless its replacement is on meta."""
    current = module._parameters[name] if name in module._parameters else module._buffers.get(name)
    if current is not tensor:
        return current is not None and current.is_meta
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return (tensor._version, tensor.data_ptr()) == written


def _only_new_visible(module: nn.Module, fresh: Mapping[int, tuple[nn.Module, str, torch.Tensor]]
                      ) -> contextlib.AbstractContextManager:
    """Behind meta stand-ins while the block runs: every tensor below ``module`` that was real
    before this materialisation, so an initialisation cannot overwrite it."""
    return behind_meta_stand_ins([(table, name, t) for table, name, t in named_state(module)
                                  if not t.is_meta and id(t) not in fresh])


def _unfilled_message(unfilled: list[tuple[nn.Module, str]], initializer: Initializer, device: torch.device,
                      no_way: bool = False) -> str:
    module = unfilled[0][0]
    kind = type(module).__name__
    names = ", ".join(f"{initializer.name(m)}.{n}".lstrip(".") for m, n in unfilled[:6])
    more = f" and {len(unfilled) - 6} more" if len(unfilled) > 6 else ""
    if no_way:
        what = (f"{initializer.name(module)} ({kind}) has parameters or buffers on the meta device ({names}{more}) "
                f"but no reset_parameters() to initialise them on {device}")
    else:
        ways = ", ".join(w.name for w in initializer.own_ways(module)) or "nothing"
        what = (f"{names}{more} ({kind}) on {device} were not filled by {ways}: training would read uninitialised "
                "memory")
    return (f"{what}. Ways out: give {kind} a reset_parameters() that fills all of its own parameters and buffers; "
            "pass param_init_fn= (called once per module, as FSDP's) to AntichainPipelineStrategy or Pipeline; or "
            "load a checkpoint that holds them (la.load_checkpoint). Buffers made in __init__ keep their values "
            "when the model is built under la.init_empty_weights(), which the strategy's empty_init uses.")


def release(modules: Iterable[nn.Module]) -> None:
    """Send the tensors each of ``modules`` holds itself back to the meta device, freeing their memory."""
    for module in modules:
        release_tensors(own_state(module), module)


def release_tensors(tensors: Iterable[torch.Tensor], owner: nn.Module) -> None:
    """Send ``tensors``, of ``owner`` or its submodules, to the meta device in place (each stays the
    same object, so optimizers and modules keep it), freeing their memory and their gradients'."""
    with weak_references_dropped(owner.modules()):
        for tensor in tensors:
            if not tensor.is_meta:
                tensor.grad = None
                _swap(tensor, torch.empty_like(tensor, device="meta"))


@contextlib.contextmanager
def weak_references_dropped(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the modules that keep weak references to their own parameters (torch's RNNs, GRUs and
    LSTMs, for cuDNN's flat weights) keep none, so that their tensors can be swapped; on leaving,
    they make them again from what they hold then, as ``RNNBase._apply`` does around ``.to()``."""
    recurrent = [m for m in modules if isinstance(m, nn.RNNBase)]
    for module in recurrent:
        module._flat_weight_refs = []
    try:
        yield
    finally:
        for module in recurrent:
            module._init_flat_weights()


def _swap(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``tensor`` hold ``value`` without replacing the object (a Parameter stays a Parameter)."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, tensor.requires_grad)
    try:
        torch.utils.swap_tensors(tensor, value)
    except RuntimeError as error:
        if "weakref" not in str(error):
            raise
        raise RuntimeError(
            f"a tensor of shape {tuple(tensor.shape)} cannot be moved between devices in place: something keeps a weak "
            f"reference to it ({error}). Torch's RNNs do, and are handled; a module of your own that keeps weak "
            "references to its parameters must drop them around .to() as nn.RNNBase._apply does, or be kept whole on "
            "one device: leave out schedule= and empty_init") from error


def _fill_for_timing(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.normal_(0.0, 0.02)
        else:
            tensor.zero_()
