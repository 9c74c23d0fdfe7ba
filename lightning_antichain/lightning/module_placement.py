"""Where the LightningModule's tensors go before and after a pipelined run.

Lightning moves the whole module to the root device before a run and back to the CPU after it.
A pipeline instead places each stage on its own device when it is built, so the root device never
holds the whole model, and a model built on the meta device is made real stage by stage.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from torch import nn

from ..weights.initialization import Initializer, ParamInitFn
from ..weights.materialize import materialize, meta_attributes


def to_root_device(module: Any, target: nn.Module, root: torch.device, param_init_fn: ParamInitFn | None) -> None:
    """Move ``module`` to ``root``, except the pipelined ``target``'s parameters and buffers: each
    stage goes from where it is (the CPU, or the meta device) straight to its own device when the
    pipeline is built. Meta tensors outside ``target`` (a loss module, a head around a pipelined
    backbone) are made real on ``root`` by their modules' ``reset_parameters()``."""
    unknown = meta_attributes(module)
    if unknown:
        raise ValueError(
            f"{type(module).__name__} holds tensors on the meta device that are not parameters or buffers "
            f"({', '.join(unknown[:4])}): nothing knows how to make them real. Build these (torchmetrics "
            "metrics, say) outside the meta context: empty_init and Trainer.init_module(empty_init=True) are for "
            "the network; create metrics in __init__ and the network in configure_model()."
        )
    staying = {id(t) for t in [*target.parameters(), *target.buffers()]}
    staying |= {id(p.grad) for p in target.parameters() if p.grad is not None}
    module._apply(lambda t: t if t.is_meta or id(t) in staying else t.to(root))
    _update_properties(module, device=root)  # what Module.to(root) would have recorded
    inside = {id(m) for m in target.modules()}
    outside = [m for m in module.modules() if id(m) not in inside]
    materialize(outside, root, "reset", Initializer(module, param_init_fn))


def real_to_cpu(module: nn.Module) -> None:
    """A run stopped before its stages were placed: what is real goes to the CPU, meta stays meta
    (Lightning's ``Module.cpu()`` would fail on it and hide the error that stopped the run)."""
    module._apply(lambda t: t if t.is_meta else t.cpu())
