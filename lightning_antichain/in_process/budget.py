"""Each stage's memory held against its budget while training runs, not only in the plan.

A plan fits every stage into its device's budget for the batches it was made for. A run can still
go over: a later batch bigger than the first (a bucketing sampler, longer sequences), a plan loaded
from a file or fixed by ``balance=``. Past a GPU's budget the allocator fails somewhere, possibly on
another stage's device, with a message that names no stage. So after each optimizer step every
stage's bytes are counted as the planner counts them (parameters, their gradients and optimizer
state, buffers, and the most its micro-batches kept for backward at once) and a stage over its
budget stops the run with an error that names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..capture.pytrees import iter_tensors
from ..measure.saved_tensors import storage_of
from ..plans.plan import Plan
from ..stages.split import StageModule


class StageOverBudgetError(RuntimeError):
    """A stage held more memory than its budget (``memory_gb``, or 90% of its GPU)."""


def state_bytes(stage: StageModule, optimizers: Iterable[Any]) -> int:
    """Bytes of the stage's parameters, their gradients, their optimizer state and its buffers,
    each storage once."""
    params = stage.parameters()
    tensors: list[torch.Tensor] = [*params, *stage.buffers(), *(p.grad for p in params if p.grad is not None)]
    for module in stage.submodules():
        tensors += list(module.buffers())
    ids = {id(p) for p in params}
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        for param, state in optimizer.state.items():
            if id(param) in ids:
                tensors += list(iter_tensors(state))
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.is_meta:
            continue
        key, nbytes = storage_of(tensor)
        seen[key] = nbytes
    return sum(seen.values())


def check_budgets(plan: Plan, stages: Sequence[StageModule], activation_bytes: Sequence[int],
                  optimizers: Iterable[Any]) -> None:
    """Raise :class:`StageOverBudgetError` for the first stage whose bytes exceed its budget."""
    optimizers = list(optimizers)
    for spec, stage, kept in zip(plan.stages, stages, activation_bytes):
        limit = spec.memory_limit_bytes
        if limit is None:
            continue
        held = state_bytes(stage, optimizers) + kept
        if held > limit:
            raise StageOverBudgetError(
                f"stage {stage.index} on {stage.device} held {held / 1e9:.3g} GB, {(held - limit) / 1e9:.3g} GB over "
                f"its budget of {limit / 1e9:.3g} GB (the plan predicted {spec.memory_bytes / 1e9:.3g} GB for "
                f"micro-batches of {plan.micro_batch_size} samples; this step kept {kept / 1e9:.3g} GB for backward). "
                "Batches bigger than the one planned for need more: plan for the biggest batch (plan again with "
                "it, or give it first), or lower the memory a stage needs: more devices, more chunks, "
                "recompute='always'."
            )
