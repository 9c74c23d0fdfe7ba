"""``la.plan``: the planning the strategy and the ``plan`` command do, as one call.

``la.profile`` + ``la.partition`` predict from the profile alone. The strategy and the command
also check the batch, read and fill the profile cache, time the optimizer, measure the stages of
a plan whose stages share the CPU or are all on GPUs, and cut again on what they measured
(:mod:`.rebalance`). This is that path, with the same defaults
(:class:`~lightning_antichain.runtime.options.PipelineOptions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..capture.signature import FlatSignature, original_forward, split_inputs
from ..runtime.batch_dims import first_micro_batch
from ..runtime.model_loss import with_items_in_batch
from ..runtime.options import PipelineOptions
from ..runtime.plan import Plan
from .planning import AUTO, Planned, plan_model


def plan(
    module: nn.Module,
    batch: Any,
    devices: Sequence[str | torch.device],
    options: PipelineOptions | None = None,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    **settings: Any,
) -> Plan:
    """The plan for ``module`` over ``devices`` (one stage each), for batches like ``batch``.

    ``batch`` is one whole batch as the pipeline will be called with, in Lightning's
    ``example_input_array`` convention (a tensor, a tuple of positional arguments, or a dict of
    keyword arguments). Settings are those of the strategy (``chunks=8``, ``memory_gb=...``,
    ``rebalance_rounds=0``, ``calibrate=False``, ...), with its defaults. ``optimizers`` are timed so
    that the predicted step includes their ``step()``. Given the same profile and calibrations (the
    profile cache), the strategy makes the same plan.
    """
    options = (options or PipelineOptions()).replace(**settings)
    args, kwargs = planning_call(module, *split_inputs(batch), options)
    return planned_for_call(module, args, kwargs, devices, options, optimizers).plan


def planning_call(module: nn.Module, args: tuple, kwargs: dict, options: PipelineOptions) -> tuple[tuple, dict]:
    """What a call of a whole batch ``args, kwargs`` is planned on: the batch itself for
    ``chunks="auto"`` (it weighs how to split it), else its first micro-batch; with the whole
    batch's token count, as the pipeline passes it, where the module computes a Hugging Face loss
    (:func:`~lightning_antichain.runtime.model_loss.with_items_in_batch`)."""
    args, kwargs = with_items_in_batch(module, args, kwargs)
    if options.chunks == AUTO:
        return args, kwargs
    return first_micro_batch(module, args, kwargs, options.chunks, options.batch_dim)


def planned_for_call(module: nn.Module, args: tuple, kwargs: dict, devices: Sequence[str | torch.device],
                     options: PipelineOptions, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Planned:
    """:func:`~.planning.plan_model` on ``args, kwargs`` as :func:`planning_call` gives them, with
    positional arguments named where keywords are given too."""
    if kwargs and args:  # keyword form: name the positional arguments too
        args, kwargs = FlatSignature.canonical(original_forward(module), args, kwargs)
    return plan_model(module, args, kwargs, devices, options, optimizers=optimizers)
