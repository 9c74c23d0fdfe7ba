"""What a step's ``self.log`` calls log when the step runs once per micro-batch.

With one process per stage, the user's step runs on the rank of the last stage, once per
micro-batch. Lightning should still see one value per name and step, logged by every rank (its
loggers and callbacks read rank 0, which holds the first stage). So the calls are recorded, not
made; after the step a value logged as a number or tensor becomes the whole batch's by its
``reduce_fx``: the mean over the micro-batches weighted by their samples (the default), their sum,
maximum or minimum; and every rank logs it (:func:`replay`). That value is the whole step's on
every rank already, so Lightning's ``sync_dist`` has nothing left to do. A torchmetrics object is
logged as it is: its state is the last stage's, copied to every rank after each step
(:func:`metric_states`, :func:`set_metric_states`), and it does not sync on its own, since every
rank holds the same state. Its value for the step (what Lightning logs ``on_step``) is the whole
batch's: a copy of it sees every micro-batch the step's calls of the metric saw
(:class:`StepValues`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

from ..capture.pytrees import map_tensors


@dataclass(frozen=True)
class MetricLogged:
    """A torchmetrics object logged under a name, found on every rank by its path in the module."""

    path: str


@dataclass
class StepLogs:
    """The ``self.log`` calls of one step's micro-batches, by name, in the order first logged."""

    calls: dict[str, list[tuple[Any, float, dict[str, Any]]]] = field(default_factory=dict)

    @contextmanager
    def recording(self, module: LightningModule, weight: float | Callable[[Any], float]
                  ) -> Generator[None, None, None]:
        """Record ``module.log`` calls of a micro-batch (not logging them), each value with the
        weight it has in the whole batch's mean: ``weight``, the micro-batch's samples (or share
        of them), or ``weight(value)`` (a loss the model computes over label tokens weighs by them)."""
        paths = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
        weight_of = weight if callable(weight) else (lambda value: weight)

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError(f"pass self.log's options by name (self.log({name!r}, value, on_step=...)) when "
                                "the step runs once per micro-batch")
            share = weight_of(value)
            if isinstance(value, Metric):
                if id(value) not in paths:
                    raise ValueError(f"the metric logged as {name!r} is not an attribute of the LightningModule; "
                                     "make it one, so that every rank finds it")
                value = MetricLogged(paths[id(value)])
            elif isinstance(value, torch.Tensor):
                value = value.detach()
            kwargs.pop("batch_size", None)
            self.calls.setdefault(name, []).append((value, share, kwargs))

        with _log_replaced(module, log):
            yield

    def merged(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """One ``(name, value, options)`` per name: the micro-batches' values reduced by the name's
        ``reduce_fx`` (:func:`reduced`), as a float with its tensor's dtype name (``None`` for a
        Python number); a metric as itself."""
        merged = []
        for name, calls in self.calls.items():
            value, _, options = calls[-1]
            if isinstance(value, MetricLogged):
                merged.append((name, value, options))
                continue
            reduce_fx = options.get("reduce_fx", "mean")
            total = reduced([float(v) for v, _, _ in calls], [weight for _, weight, _ in calls], reduce_fx)
            dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None
            merged.append((name, (total, dtype), options))
        return merged


def reduced(values: list[float], samples: list[float], reduce_fx: Any) -> float:
    """Values logged for parts of a batch of ``samples`` samples each (or another weight), as the
    whole batch's, by ``self.log``'s ``reduce_fx``: ``"mean"`` (weighted), ``"sum"``, ``"max"`` or
    ``"min"`` (or torch's functions of those names)."""
    kind = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    kind = {"avg": "mean", "amax": "max", "amin": "min"}.get(kind, kind)
    if kind == "sum":
        return sum(values)
    if kind == "max":
        return max(values)
    if kind == "min":
        return min(values)
    total = sum(samples)
    return sum(v * n for v, n in zip(values, samples)) / total


def averaged_logs(shares: list[list[tuple[str, Any, dict[str, Any]]]], samples: list[int]
                  ) -> list[tuple[str, Any, dict[str, Any]]]:
    """What :meth:`StepLogs.merged` gave for each share of a batch (of ``samples`` samples each),
    as one, each value reduced over the shares by its ``reduce_fx`` (a metric as itself)."""
    first = shares[0]
    values = [dict((n, v) for n, v, _ in share) for share in shares]
    return [(name, value if isinstance(value, MetricLogged) else (
        reduced([v[name][0] for v in values], samples, options.get("reduce_fx", "mean")), value[1]), options)
        for name, value, options in first]


def replay(module: LightningModule, merged: list[tuple[str, Any, dict[str, Any]]], batch_size: int,
           device: torch.device) -> None:
    """Log what :meth:`StepLogs.merged` gave, on this rank, for a batch of ``batch_size`` samples."""
    for name, value, options in merged:
        if isinstance(value, MetricLogged):
            module.log(name, module.get_submodule(value.path), batch_size=batch_size, **options)
        else:
            number, dtype = value
            module.log(name, number if dtype is None else torch.tensor(number, dtype=getattr(torch, dtype),
                                                                       device=device),
                       batch_size=batch_size, **options)


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


@contextmanager
def metrics_kept(module: LightningModule) -> Generator[None, None, None]:
    """Inside, steps may update ``module``'s torchmetrics; on leaving, their states are as they were."""
    states = map_tensors(lambda t: t.clone(), metric_states(module))
    try:
        yield
    finally:
        set_metric_states(module, states)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


class StepValues:
    """Each torchmetrics object's value for a step's whole batch, where the step runs once per
    micro-batch: what its ``forward`` would have returned for the batch, and what Lightning logs
    ``on_step`` (the metric's ``_forward_cache``). A copy of each metric, made once and reset for
    every step, is updated with whatever the step's calls of the metric were given."""

    def __init__(self) -> None:
        self._copies: dict[str, Metric] = {}
        self._seen: set[str] = set()

    @contextmanager
    def watching(self, module: LightningModule) -> Generator[None, None, None]:
        """Within, every call of one of ``module``'s metrics also updates its copy (the step's)."""
        metrics = metrics_of(module)
        self._seen = set()
        for path, metric in metrics.items():
            copied = self._copies.get(path)
            if copied is None:
                copied = self._copies[path] = copy.deepcopy(metric, {id(metric.process_group): metric.process_group})
            copied.reset()
            metric.forward = self._forward(path, metric, copied)  # an instance attribute wins over the method
        try:
            yield
        finally:
            for metric in metrics.values():
                vars(metric).pop("forward", None)

    def _forward(self, path: str, metric: Metric, copied: Metric) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            self._seen.add(path)
            copied.update(*args, **kwargs)
            return type(metric).forward(metric, *args, **kwargs)

        return forward

    def values(self) -> dict[str, torch.Tensor]:
        """The step's value of each metric the step called, by path, as CPU tensors."""
        return {path: _to(self._copies[path].compute(), torch.device("cpu")) for path in self._seen}


def set_step_values(module: LightningModule, values: dict[str, Any]) -> None:
    """Give each metric the step's value :meth:`StepValues.values` took (on another rank, maybe)."""
    metrics = metrics_of(module)
    for path, value in values.items():
        metrics[path]._forward_cache = _to(value, metrics[path].device)
