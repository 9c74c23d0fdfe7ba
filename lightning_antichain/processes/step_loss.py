"""The user's training step as a loss of the pipelined module's output, for the planner to time.

With one process per stage, the last stage's rank runs the rest of ``training_step`` (the loss,
what it logs) on every micro-batch's output, work beyond the model's last operations that the
model's profile does not hold: an 8k-vocabulary decoder's cross-entropy took 8-9% of the model's
forward and backward on the 2-core test machine (``benchmarks/step_loss_cpu.py``). The planner
charges a loss given to it to the output it reads
(:func:`~lightning_antichain.planner.cost_graph.with_loss`), so that the cut gives that stage
less of the model; :func:`step_loss` makes that loss from the step itself, on the micro-batch
whose samples the output holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..batches import microbatch
from .micro_batch_steps import MicroBatchSteps
from .step_logs import StepLogs


def step_loss(steps: MicroBatchSteps, hook: str, batch: Any, rest: tuple) -> Callable[[Any], torch.Tensor | None]:
    """The loss the step ``hook`` returns when the module answers an output, for the first samples
    of ``batch``, as many as the output holds; ``None`` where the step returns none (it skips the
    batch, or fails: training then says why) or the output's samples cannot be matched to the
    batch's. What the step logs is dropped; its torchmetrics change (keep them with
    :func:`~.step_logs.metrics_kept`)."""
    try:
        size = microbatch.batch_size(batch)
    except (RuntimeError, ValueError):
        size = None
    split: dict[int | None, Any] = {}  # by the output's samples: the timed calls split the batch once

    def loss(output: Any) -> torch.Tensor | None:
        try:
            samples = microbatch.batch_size(output)
        except (RuntimeError, ValueError):
            return None
        if samples not in split:
            split[samples] = first_samples(batch, size, samples)
        micro = split[samples]
        if micro is None:
            return None
        try:
            value = loss_of(steps.result_of(hook, micro, rest, output, StepLogs(), 1.0), hook)
        except Exception:  # noqa: BLE001 - the first training step runs it again and reports what it raises
            return None
        return value if value.requires_grad else None

    return loss


def loss_of(result: Any, hook: str) -> torch.Tensor:
    """The micro-batch's loss in what the step ``hook`` returned; a clear error where there is none."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"{hook} returned {type(result).__name__}; with one process per stage it must return the "
                         "micro-batch's loss, a scalar tensor (or a dict with one under 'loss')")
    return loss


def first_samples(batch: Any, size: int | None, samples: int | None) -> Any:
    """The micro-batch of ``batch``'s (of ``size`` samples) first ``samples``, split as the
    pipeline splits it, or ``None`` where no split starts with that many."""
    if not size or not samples:
        return None
    for chunks in range(1, size + 1):
        if microbatch.split_sizes(size, chunks)[0] == samples:
            return microbatch.scatter(batch, chunks, lists=True)[0]
    return None

