"""What gives a module's new parameters and buffers their first values when it is made real.

A model built on the meta device has shapes but no values. When a stage is made real, each module
whose tensors are new is initialised in one of three ways, the first that applies:

1. the user's ``param_init_fn(module)``, called once per module, as FSDP1 called it;
2. the ``_init_weights(module)`` of the innermost Hugging Face ``PreTrainedModel`` that holds the
   module, as its ``post_init()`` would have called it (ancestors too, children first, as
   ``Module.apply`` and Hugging Face do: a parent such as T5's attention initialises its children);
3. the module's own ``reset_parameters()``, Lightning's and torch's contract for meta models.

A peft LoRA layer then initialises its adapters as peft does (``reset_lora_parameters``: A as
``nn.Linear``, B zero, so the adapted model starts as the base model).

Nothing here decides whether the values are complete: :mod:`.materialize` checks every new tensor
afterwards, whatever filled it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]
"""Fills the parameters and buffers ``module`` holds itself (they are on their device, empty)."""


def is_hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``, without importing transformers."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__) and callable(getattr(module, "_init_weights", None))


@dataclass(frozen=True)
class Way:
    """One way to initialise a module: what it is called in messages, and the call."""

    name: str
    run: Callable[[], None]


class Initializer:
    """The ways to initialise each module of the model rooted at ``root`` (``None``: each module
    by its own ``reset_parameters()``, named by its type)."""

    def __init__(self, root: nn.Module | None, param_init_fn: ParamInitFn | None = None) -> None:
        self.param_init_fn = param_init_fn
        self.names = {} if root is None else {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        self._parents: dict[int, nn.Module] = {}
        self._hugging_face: dict[int, nn.Module] = {}  # module -> the innermost PreTrainedModel holding it
        self._lora_init: dict[str, object] = {}  # adapter name -> peft's init_lora_weights
        for module in ([] if root is None else root.modules()):
            for child in module.children():
                self._parents.setdefault(id(child), module)
            if is_hugging_face_model(module):
                self._hugging_face.update((id(m), module) for m in module.modules())
            configs = getattr(module, "peft_config", None)
            if isinstance(configs, dict):
                self._lora_init.update((name, getattr(c, "init_lora_weights", True)) for name, c in configs.items())

    def name(self, module: nn.Module) -> str:
        """``module``'s qualified name in the model (its type where it is the root)."""
        return self.names.get(id(module)) or type(module).__name__

    def depth(self, module: nn.Module) -> int:
        name = self.names.get(id(module), "")
        return name.count(".") + 1 if name else 0

    def ancestors(self, module: nn.Module) -> Iterator[nn.Module]:
        """The modules above ``module``, nearest first, whose initialisation reaches into it."""
        parent = self._parents.get(id(module))
        while parent is not None:
            if self.ancestor_ways(parent):
                yield parent
            parent = self._parents.get(id(parent))

    def own_ways(self, module: nn.Module) -> list[Way]:
        """How to fill the new tensors ``module`` holds itself, to try in order until they are full."""
        if self.param_init_fn is not None:
            fn = self.param_init_fn
            return [Way("param_init_fn", lambda: fn(module))]
        ways = self.ancestor_ways(module)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            ways.append(Way("reset_parameters()", reset))
        return ways

    def ancestor_ways(self, module: nn.Module) -> list[Way]:
        """How a module above new tensors initialises them: Hugging Face's ``_init_weights`` and a
        LoRA layer's ``reset_lora_parameters`` reach into children (``reset_parameters()`` fills
        a module's own tensors only)."""
        if self.param_init_fn is not None:
            return []
        ways = []
        owner = self._hugging_face.get(id(module))
        if owner is not None:
            ways.append(Way(f"{type(owner).__name__}._init_weights", lambda: _hugging_face_init(owner, module)))
        lora = self._lora_way(module)
        if lora is not None:
            ways.append(lora)
        return ways

    def _lora_way(self, module: nn.Module) -> Way | None:
        reset, adapters = getattr(module, "reset_lora_parameters", None), getattr(module, "lora_A", None)
        if not callable(reset) or not isinstance(adapters, nn.ModuleDict):
            return None
        inits = {name: self._lora_init.get(name, True) for name in adapters}
        if any(init not in (True, "gaussian") for init in inits.values()):  # PiSSA, OLoRA, ...: from the base weights
            return None

        def run() -> None:
            for name, init in inits.items():
                reset(name, init)

        return Way("reset_lora_parameters()", run)


def _hugging_face_init(owner: nn.Module, module: nn.Module) -> None:
    """``owner._init_weights(module)``, on tensors Hugging Face has not marked as loaded: its init
    functions skip a tensor flagged ``_is_hf_initialized``, a flag that is not ours to trust."""
    for tensor in [*module.parameters(recurse=True), *module.buffers(recurse=True)]:
        tensor.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        owner._init_weights(module)  # type: ignore[operator]
