"""Build a model without memory for its parameters, keeping the buffers it computes.

``torch.device("meta")`` puts every tensor on meta, buffers too. A buffer computed in ``__init__``
(a causal mask, a rotary ``inv_freq`` table) then has no values, is in no checkpoint when it is
non-persistent, and its module often has no ``reset_parameters()`` to compute it again. Under
:func:`init_empty_weights` only parameters go on meta; buffers are made as usual, as accelerate's
``init_empty_weights()`` does by default. Buffers are small beside the weights.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch import nn

_lock = threading.Lock()
_depth = 0
_register_parameter = nn.Module.register_parameter


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _register_parameter(module, name, param)
    if param is not None and not param.is_meta:
        table = module._parameters
        kind = type(param)
        table[name] = kind(param.to("meta"), requires_grad=param.requires_grad)  # type: ignore[call-arg]
        table[name].__dict__.update(param.__dict__)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation
    cost) and their buffers where tensors are made by default, with the values ``__init__`` gives.

        with la.init_empty_weights():
            model = LlamaForCausalLM(config)  # 70 B parameters, none of them in memory
        la.load_checkpoint(model, "llama/")   # each stage reads its own part when it is placed

    Each parameter is made where ``__init__`` makes it (``torch.empty``: memory is reserved, never
    written) and moved to meta as it is registered, before the module initialises it.
    """
    global _depth
    with _lock:
        _depth += 1
        nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]

