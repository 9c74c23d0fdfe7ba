"""``la.plan`` and ``la.plan_layout``: the planning the strategy and the ``plan`` command do, as
one call each (a pipeline on given devices; the layout of replicas and stages for a count of ranks).

``la.profile`` + ``la.partition`` predict from the profile alone. The strategy and the command
also check the batch, read and fill the profile cache, time the optimizer, measure the stages of
a plan whose stages share the CPU or are all on GPUs, and cut again on what they measured
(:mod:`.rebalance`). This is that path, with the same defaults
(:class:`~lightning_antichain.plans.options.PipelineOptions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..batches.batch_dims import first_micro_batch
from ..batches.model_loss import with_items_in_batch
from ..capture.signature import FlatSignature, original_forward, split_inputs
from ..plans.options import PipelineOptions
from ..plans.plan import Plan
from .planning import AUTO, Planned, plan_model
from .target_profile import TargetModel


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


def planning_call(module: nn.Module, args: tuple, kwargs: dict, options: PipelineOptions, count_items: bool = True
                  ) -> tuple[tuple, dict]:
    """What a call of a whole batch ``args, kwargs`` is planned on: the batch itself for
    ``chunks="auto"`` (it weighs how to split it), else its first micro-batch; with the whole
    batch's token count, as the pipeline passes it, where the module computes a Hugging Face loss
    (:func:`~lightning_antichain.batches.model_loss.with_items_in_batch`), unless ``count_items``
    is off (stages as processes call the module as the step does, per micro-batch)."""
    if count_items:
        args, kwargs = with_items_in_batch(module, args, kwargs)
    if options.chunks == AUTO:
        return args, kwargs
    return first_micro_batch(module, args, kwargs, options.chunks, options.batch_dim)


def planned_for_call(module: nn.Module, args: tuple, kwargs: dict, devices: Sequence[str | torch.device],
                     options: PipelineOptions, optimizers: Sequence[torch.optim.Optimizer] = (),
                     loss: Callable[[Any], torch.Tensor | None] | None = None) -> Planned:
    """:func:`~.planning.plan_model` on ``args, kwargs`` as :func:`planning_call` gives them, with
    positional arguments named where keywords are given too."""
    if kwargs and args:  # keyword form: name the positional arguments too
        args, kwargs = FlatSignature.canonical(original_forward(module), args, kwargs)
    return plan_model(module, args, kwargs, devices, options, optimizers=optimizers, loss=loss)


def plan_layout(
    module: nn.Module,
    batch: Any,
    ranks: int,
    options: PipelineOptions | None = None,
    *,
    device: str | torch.device = "cpu",
    per_node: int | None = None,
    stages: int | str = AUTO,
    schedule: str = AUTO,
    virtual_stages: int | None = None,
    replication: str = "ddp",
    internode_gbps: float | None = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    profile_device: str | torch.device | None = None,
    target: TargetModel | None = None,
    **settings: Any,
) -> Plan:
    """The plan of the fastest layout of ``ranks`` processes that fits, for whole batches like
    ``batch``: ``pipeline_parallel_size="auto"`` weighs every ``dp x pp``, ``schedule="auto"`` every schedule (both
    the defaults, as in the ``plan`` command), and each even micro-batch count, as the strategy does
    with those settings (``plan.layout`` the
    layout, ``plan.layouts`` every candidate and why it lost). ``device``: the kind of device each
    rank has (``"cuda"``: rank ``r`` on GPU ``r % per_node``), where the model is also profiled;
    ``per_node``: ranks per node (default: all on one), their links at ``bandwidth_gbps`` and
    across nodes at ``internode_gbps`` (default: the strategy's). ``profile_device``: where the
    model is profiled, if not on ``device`` (the CPU, to plan for GPUs this machine lacks).
    ``target``: the GPUs the ranks will have, where this machine has none of them: the model is
    not profiled but costed on their roofline and links (:mod:`.target_profile`), the ranks'
    memory theirs unless ``memory_gb`` says otherwise; ``device`` must then be ``"cuda"``."""
    from ..device import is_accelerator
    from ..plans.process_schedules import process_schedule
    from .layout_cost import Links
    from .layout_search import LayoutSearch, layout_search, plan_layouts
    from .planning import INTERNODE_GPU_GBPS, default_bandwidth_gbps

    options = (options or PipelineOptions()).replace(**settings)
    if ranks < 1 or (stages != AUTO and (not isinstance(stages, int) or stages < 1 or ranks % stages)):
        raise ValueError(f"ranks={ranks} must be at least 1, and stages={stages!r} 'auto' or a divisor of it")
    device = torch.device(device)
    per_node = per_node or ranks
    first = device.index or 0

    def devices_of(layout: Any, chosen: Any) -> list[torch.device]:
        held = [layout.rank(0, chosen.rank_of(s, layout.pp)) for s in range(chosen.num_stages(layout.pp))]
        return [torch.device(device.type, first + r % per_node) if is_accelerator(device) else device for r in held]

    search = layout_search(stages, schedule, virtual_stages) or LayoutSearch(
        int(stages), (process_schedule(schedule, virtual_stages),))
    if target is not None:
        if not is_accelerator(device):
            raise ValueError(f"a target GPU ({target.device.name}) is for ranks on cuda, not {device}")
        links = target.links(per_node, options.bandwidth_gbps, internode_gbps)
        if options.memory_gb is None:
            options = options.replace(memory_gb=target.memory_gb)
    else:
        within = options.bandwidth_gbps if options.bandwidth_gbps is not None else default_bandwidth_gbps([device])
        across = internode_gbps if internode_gbps is not None else (
            INTERNODE_GPU_GBPS if is_accelerator(device) else within)
        links = Links(per_node, within, across)
    args, kwargs = split_inputs(batch)
    return plan_layouts(module, args, kwargs, ranks, devices_of, search, links, options,
                        optimizers=optimizers, replication=replication,
                        profile_device=torch.device(profile_device) if profile_device is not None else device,
                        target=target).plan
