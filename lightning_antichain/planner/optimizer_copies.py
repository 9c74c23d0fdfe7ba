"""Fresh optimizers like the user's over copies of their parameters: what planning times an
optimizer step on, leaving the user's optimizer, parameters and gradients untouched."""

from __future__ import annotations

import math

import torch
from torch import nn


def optimizer_copies(optimizers: list[torch.optim.Optimizer], budget_bytes: int = 256 * 2**20,
                     device: torch.device | None = None, share: int = 1) -> list[tuple[torch.optim.Optimizer, float]]:
    """Fresh optimizers like ``optimizers`` over copies of (the first ``budget_bytes`` of) their
    parameters, each with what its bytes scale by to the whole (see
    :func:`~lightning_antichain.planner.overhead.optimizer_step_s`). ``share``: copy only the
    first ``1/share`` of each optimizer's parameter bytes (at least one tensor), what a rank
    steps where a layout gives it that share of the model."""
    copies = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        state = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = [p.numel() * p.element_size() for p in state]
        budget = min(budget_bytes, math.ceil(sum(sizes) / share))
        on_meta = any(p.is_meta for p in state)
        if on_meta:  # the model is not real anywhere: stay far below its size, even its largest tensor
            budget = max(min(budget // 4, sum(sizes) // 8), min(sizes, default=0))
        groups, copied, all_bytes = [], 0, 0
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                size = p.numel() * p.element_size()
                all_bytes += size
                if (copied + size <= budget) if on_meta else (copied < budget or not copied):
                    copy = nn.Parameter(torch.randn_like(p, device=device) if p.is_meta else
                                        p.detach().to(device or p.device, copy=True))
                    copy.grad = p.grad.detach().to(copy.device, copy=True) if p.grad is not None else (
                        torch.randn_like(copy))
                    params.append(copy)
                    copied += size
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        if not groups or not copied:
            continue
        try:
            copies.append((type(optimizer)(groups), all_bytes / copied))
        except Exception:  # noqa: BLE001 - an optimizer with its own constructor: not measured
            continue
    return copies
