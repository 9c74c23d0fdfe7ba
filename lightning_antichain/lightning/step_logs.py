"""What a step's ``self.log`` calls log when the step runs once per micro-batch.

With one process per stage, the user's step runs on the rank of the last stage, once per
micro-batch. Lightning should still see one value per name and step, logged by every rank (its
loggers and callbacks read rank 0, which holds the first stage). So the calls are recorded, not
made; after the step a value logged as a number or tensor becomes its mean over the micro-batches,
weighted by their samples, and every rank logs it (:func:`replay`). A torchmetrics object is
logged as it is: its state is the last stage's, copied to every rank after each step
(:func:`metric_states`, :func:`set_metric_states`), and it does not sync on its own, since every
rank holds the same state.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric


@dataclass(frozen=True)
class MetricLogged:
    """A torchmetrics object logged under a name, found on every rank by its path in the module."""

    path: str


@dataclass
class StepLogs:
    """The ``self.log`` calls of one step's micro-batches, by name, in the order first logged."""

    calls: dict[str, list[tuple[Any, int, dict[str, Any]]]] = field(default_factory=dict)

    @contextmanager
    def recording(self, module: LightningModule, samples: int) -> Generator[None, None, None]:
        """Record ``module.log`` calls of a micro-batch of ``samples`` samples (not logging them)."""
        paths = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError(f"pass self.log's options by name (self.log({name!r}, value, on_step=...)) when "
                                "the step runs once per micro-batch")
            if isinstance(value, Metric):
                if id(value) not in paths:
                    raise ValueError(f"the metric logged as {name!r} is not an attribute of the LightningModule; "
                                     "make it one, so that every rank finds it")
                value = MetricLogged(paths[id(value)])
            elif isinstance(value, torch.Tensor):
                value = value.detach()
            kwargs.pop("batch_size", None)
            self.calls.setdefault(name, []).append((value, samples, kwargs))

        with _log_replaced(module, log):
            yield

    def merged(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """One ``(name, value, options)`` per name: the mean over micro-batches weighted by their
        samples, as a float with its dtype's name; a metric as itself."""
        merged = []
        for name, calls in self.calls.items():
            value, _, options = calls[-1]
            if isinstance(value, MetricLogged):
                merged.append((name, value, options))
                continue
            total = sum(samples for _, samples, _ in calls)
            mean = sum(float(v) * samples for v, samples, _ in calls) / total
            dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else "float32"
            merged.append((name, (mean, dtype), options))
        return merged


def averaged_logs(shares: list[list[tuple[str, Any, dict[str, Any]]]]) -> list[tuple[str, Any, dict[str, Any]]]:
    """What :meth:`StepLogs.merged` gave for each of equal shares of a batch, as one: each value
    the mean of the shares' (a metric as itself)."""
    first = shares[0]
    means = {name: sum(dict((n, v) for n, v, _ in share)[name][0] for share in shares) / len(shares)
             for name, value, _ in first if not isinstance(value, MetricLogged)}
    return [(name, value if isinstance(value, MetricLogged) else (means[name], value[1]), options)
            for name, value, options in first]


def replay(module: LightningModule, merged: list[tuple[str, Any, dict[str, Any]]], batch_size: int,
           device: torch.device) -> None:
    """Log what :meth:`StepLogs.merged` gave, on this rank, for a batch of ``batch_size`` samples."""
    for name, value, options in merged:
        if isinstance(value, MetricLogged):
            module.log(name, module.get_submodule(value.path), batch_size=batch_size, **options)
        else:
            mean, dtype = value
            module.log(name, torch.tensor(mean, dtype=getattr(torch, dtype), device=device), batch_size=batch_size,
                       **options)


@contextmanager
def discarded(module: LightningModule) -> Generator[None, None, None]:
    """``module.log`` does nothing inside (a step run only to take the module's arguments)."""
    with _log_replaced(module, lambda *args, **kwargs: None):
        yield


@contextmanager
def _log_replaced(module: LightningModule, log: Any) -> Generator[None, None, None]:
    module.log = log  # an instance attribute wins over the method; removing it restores the method
    try:
        yield
    finally:
        vars(module).pop("log", None)


def metrics_of(module: LightningModule) -> dict[str, Metric]:
    """The torchmetrics objects that hold state (not collections of them), by path."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric) and m._defaults}


def unsynced(module: LightningModule, replicas: Any = None) -> None:
    """Every rank of a pipeline holds the same metric states: computing one must not sum them over
    its ranks. Where pipelines train side by side, each metric syncs over the ``replicas`` group
    (one rank of each pipeline) only, as under DDP over all of them."""
    for metric in metrics_of(module).values():
        if replicas is not None:
            metric.process_group = replicas
            continue
        metric.sync_on_compute = False
        metric._to_sync = False
        metric.dist_sync_on_step = False


def metric_states(module: LightningModule) -> dict[str, dict[str, Any]]:
    """Each metric's state, as CPU tensors, with its count of updates."""
    states = {}
    for path, metric in metrics_of(module).items():
        state: dict[str, Any] = {name: _to(getattr(metric, name), torch.device("cpu")) for name in metric._defaults}
        state["_update_count"] = metric._update_count
        states[path] = state
    return states


def set_metric_states(module: LightningModule, states: dict[str, dict[str, Any]]) -> None:
    """Give each metric the state :func:`metric_states` took on another rank."""
    metrics = metrics_of(module)
    for path, state in states.items():
        metric = metrics[path]
        state = dict(state)
        metric._update_count = state.pop("_update_count")
        metric._computed = None
        for name, value in state.items():
            setattr(metric, name, _to(value, metric.device))


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value
