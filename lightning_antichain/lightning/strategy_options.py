"""The strategy's arguments: their current names, their checks, and the one options object they make.

LightningCLI passes the strategy's arguments flat, as its YAML holds them. Here they become
:class:`~lightning_antichain.plans.options.PipelineOptions`, the one copy the planner and the
runtime read; old names keep working with a deprecation warning; and which arguments a user gave
(those that differ from their defaults) is known, so that a runtime can refuse the ones it would
ignore (:meth:`~lightning_antichain.lightning.runtime.Runtime.refuse_foreign`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..planner.planning import AUTO
from ..plans.options import PipelineOptions

#: old argument name: (its current name, how an old value reads under it, what to tell the user)
RENAMED: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "stages": ("pipeline_parallel_size", lambda value: value,
               "stages= is now pipeline_parallel_size= (it counts devices, or processes, per pipeline; a pipeline "
               "can hold more stages than that)"),
    "use_profile_cache": ("profile_cache", lambda value: True if value else False,
                          "use_profile_cache= is now part of profile_cache=: give profile_cache=False to cache no "
                          "profile"),
    "checkpoint": ("recompute", lambda value: value,
                   "checkpoint= is now recompute= (it recomputes activations in backward; Lightning's checkpoints are "
                   "something else)"),
}


def current_arguments(init: Callable[..., None], arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``arguments`` of ``init`` (its ``locals()``) under their current names, with a warning for
    each old name given, and those of them that differ from their defaults (what the user gave)."""
    parameters = {n: p for n, p in inspect.signature(init).parameters.items() if n != "self"}
    current = {name: arguments[name] for name in parameters if name not in RENAMED}
    for old, (new, value_of, message) in RENAMED.items():
        if arguments[old] is not None:
            warnings.warn(f"{message}. The old name still works for now.", DeprecationWarning, stacklevel=3)
            if new == "profile_cache" and arguments[old] and current[new] is not True:
                continue  # use_profile_cache=True beside a directory: the directory
            current[new] = value_of(arguments[old])
    given = {name: value for name, value in current.items() if value != parameters[name].default}
    check_arguments(current)
    return current, given


def check_arguments(arguments: dict[str, Any]) -> None:
    """Clear errors for arguments that contradict each other, or a value of the wrong kind."""
    size, placement = arguments["pipeline_parallel_size"], arguments["placement"]
    if arguments["plan"] is not None and arguments["balance"] is not None:
        raise ValueError("give either plan= or balance=, not both")
    if size is not None and size != AUTO and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f'pipeline_parallel_size must be a whole number of at least 1, or "auto", got {size!r}')
    trials = arguments["layout_trials"]
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
        raise ValueError(f"layout_trials is how many of the layouts predicted fastest to time on the first batch: a "
                         f"whole number of at least 1 (1: the prediction's choice), got {trials!r}")
    if arguments["schedule"] is None and size == AUTO:
        raise ValueError('pipeline_parallel_size="auto" chooses the layout of stages as processes: give schedule= too '
                         '(a name, or "auto" to choose it as well)')
    if placement is not None and (not placement or any(not isinstance(i, int) or i < 0 for i in placement)):
        raise ValueError(f"placement must list a device index (0, 1, ...) for each stage, got {placement}")


def pipeline_options(arguments: dict[str, Any]) -> PipelineOptions:
    """The planning and running settings the strategy's ``arguments`` (current names) give."""
    cache = arguments["profile_cache"]
    taken = ("chunks", "recompute", "batch_dim", "check_batch", "deferred_batch_norm", "method", "bandwidth_gbps",
             "internode_gbps", "memory_gb", "optimizer_multiplier", "calibrate", "rebalance_rounds", "cpu_threads",
             "param_init_fn", "compile_stages")
    balance = arguments["balance"]
    return PipelineOptions(
        **{name: arguments[name] for name in taken},
        leaf_modules=tuple(arguments["leaf_modules"] or ()),
        balance=None if balance is None else tuple(balance),
        profile_cache=None if isinstance(cache, bool) else Path(cache),
        use_profile_cache=cache is not False,
    )
