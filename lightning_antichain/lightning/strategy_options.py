"""The strategy's arguments as the frozen options every part reads, made in two moments only.

LightningCLI passes the strategy's arguments flat, as its YAML holds them. When the strategy is
made, they are checked (:func:`~lightning_antichain.plans.options.check_strategy_arguments`) and
become :class:`~lightning_antichain.plans.options.PipelineOptions` (what the planner and the
stages read), and, with ``schedule=``, :class:`~lightning_antichain.plans.options.ProcessOptions`.
What only the Trainer knows (the devices, how many batches it accumulates) is folded in once per
run, when the Trainer sets the strategy up (:func:`run_options`), from the options as made: nothing
else writes them.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..measure.cpu_threads import stage_threads
from ..planner.planning import default_memory_gb
from ..plans.options import PipelineOptions, ProcessOptions, check_strategy_arguments


def current_arguments(init: Callable[..., None], arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` of ``init`` (its ``locals()``), once checked (:func:`check_strategy_arguments`,
    told which the user gave: those that differ from their defaults)."""
    parameters = {n: p for n, p in inspect.signature(init).parameters.items() if n != "self"}
    current = {name: arguments[name] for name in parameters}
    given = {name: value for name, value in current.items() if value != parameters[name].default}
    check_strategy_arguments(current, given)
    return current


def pipeline_options(arguments: dict[str, Any], processes: ProcessOptions | None) -> PipelineOptions:
    """The planning and running settings the strategy's ``arguments`` give. Stages as processes
    (``processes``: their settings) are planned for the memory their schedule keeps, on
    micro-batch counts torch's schedules take, and not calibrated in process (they time their own
    first steps)."""
    cache = arguments["profile_cache"]
    taken = ("chunks", "recompute", "batch_dim", "check_batch", "deferred_batch_norm", "method", "bandwidth_gbps",
             "internode_gbps", "memory_gb", "optimizer_multiplier", "calibrate", "rebalance_rounds", "cpu_threads",
             "param_init_fn", "compile_stages")
    balance = arguments["balance"]
    options = PipelineOptions(
        **{name: arguments[name] for name in taken},
        leaf_modules=tuple(arguments["leaf_modules"] or ()),
        balance=None if balance is None else tuple(balance),
        profile_cache=None if isinstance(cache, bool) else Path(cache),
        use_profile_cache=cache is not False,
    )
    if processes is None:
        return options
    return options.replace(schedule=processes.memory_schedule, calibrate=False, even_chunks=True)


def process_options(arguments: dict[str, Any]) -> ProcessOptions | None:
    """The settings of stages as processes (``None`` without ``schedule=``)."""
    if arguments["schedule"] is None:
        return None
    return ProcessOptions(schedule=arguments["schedule"], virtual_stages=arguments["virtual_stages"],
                          pipeline_ranks=arguments["pipeline_parallel_size"], replication=arguments["replication"],
                          layout_trials=arguments["layout_trials"] or 1, calibrate_steps=arguments["calibrate"])


def run_options(options: PipelineOptions, *, devices: Sequence[torch.device], pipeline_devices: Sequence[torch.device],
                slots: Sequence[int] | None, processes: int, accumulate_grad_batches: int) -> PipelineOptions:
    """``options`` (as made with the strategy) for one run on ``devices`` (the node's), of which
    this process drives ``pipeline_devices``, each stage on the one of them ``slots`` names
    (``None``: a process per stage): replicas share the node's cores; stages placed on one device
    split its memory."""
    changes: dict[str, Any] = {"accumulate_grad_batches": accumulate_grad_batches}
    if options.cpu_threads is None and processes > 1:
        changes["cpu_threads"] = stage_threads(devices)
    if slots is not None:
        changes["device_slots"] = tuple(slots)
        if tuple(slots) != tuple(range(len(pipeline_devices))):  # placed: each stage its device's share
            changes["memory_gb"] = shared_memory_gb(options.memory_gb, pipeline_devices, slots)
    return options.replace(**changes)


def shared_memory_gb(given: float | tuple[float | None, ...] | None, devices: Sequence[torch.device],
                     placement: Sequence[int]) -> tuple[float | None, ...]:
    """Each stage's memory budget, of the ``given`` one per device (``None``: the devices'):
    stages placed on one device split it equally."""
    per_device = (list(given) if isinstance(given, tuple) else [given] * len(devices)) if given is not None else (
        default_memory_gb(devices))
    if len(per_device) != len(devices):
        raise ValueError(f"memory_gb lists {len(per_device)} values for {len(devices)} devices per pipeline; give one "
                         "per device, or one number for every device")
    sharing = Counter(placement)
    return tuple(None if per_device[i] is None else per_device[i] / sharing[i] for i in placement)

