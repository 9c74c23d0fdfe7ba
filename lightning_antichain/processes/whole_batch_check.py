"""The first step of each kind run once more on the whole batch, so that a value the step computes
from its batch as a whole is found, not joined from the micro-batches' silently.

With one process per stage the user's step runs once per micro-batch, and what it gives joins: the
loss and logged values by their samples (or ``reduce_fx``), returned tensors by their rows. That is
the whole batch's value only where the step computes per sample. A loss normalised inside the step
by the batch's own weights (``(w * losses).sum() / w.sum()``), a count of the batch's samples, a
statistic across samples: each comes out as the micro-batches', and trains or reports something
else than plain Lightning. At the first step of each kind (training, validation, test, predict),
the last stage's rank holds every micro-batch's output. It joins them into the whole batch's
output (the forward is per sample: the batch-dependence check saw to it), runs the step once more
on the whole batch with that output standing for the module's, and compares the loss, each logged
value and each returned value with what the micro-batches gave. Where one differs beyond the
rounding of its dtype, every rank stops with a :class:`~..batches.batch_dependence.BatchDependenceError`
naming it. The extra run's logs and torchmetrics updates are dropped and its random draws undone;
a step that draws random numbers (its values differ from run to run) is not compared, nor is one
whose output does not join exactly. ``check_batch=False`` turns the check off.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..batches import microbatch
from ..batches.microbatch import MicroBatchError
from ..capture.pytrees import flatten, unflatten
from ..device import generator_states, rng_forked
from .micro_batch_steps import MicroBatchSteps
from .step_logs import MetricLogged, StepLogs, metrics_kept
from .step_loss import loss_of

HOOKS = ("training_step", "validation_step", "test_step", "predict_step")

#: how far apart a value joined from micro-batches and the whole batch's may be, relative to its
#: size, by dtype: sums in another order round differently, more in a narrow dtype
ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass
class MicroBatchesSeen:
    """What each micro-batch of one step gave on the last stage's rank: the module's output
    (detached leaves), the weight of each 0-dim floating-point leaf in the whole batch's value, and
    what the step returned."""

    outputs: list[tuple[list[Any], Any]] = field(default_factory=list)
    weights: list[list[float | None]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    loss_weights: list[float] = field(default_factory=list)

    def keep(self, output: Any, share: Callable[[Any], float], result: Any) -> None:
        leaves, spec = flatten(output)
        self.weights.append([share(v) if _is_scalar(v) else None for v in leaves])
        loss = result.get("loss") if isinstance(result, dict) else result
        self.loss_weights.append(share(loss))
        self.outputs.append(([v.detach() if isinstance(v, torch.Tensor) else v for v in leaves], spec))
        self.results.append(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result))


class WholeBatchCheck:
    """Which step kinds are still to be checked, and the check of one (module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self._pending = set(HOOKS) if enabled else set()

    def watch(self, hook: str) -> MicroBatchesSeen | None:
        """A record to keep this step's micro-batches in, where ``hook`` is still to be checked."""
        if hook not in self._pending:
            return None
        self._pending.discard(hook)
        return MicroBatchesSeen()

    @staticmethod
    def problem(seen: MicroBatchesSeen, steps: MicroBatchSteps, hook: str, batch: Any, rest: tuple, sizes: list[int],
                logs: StepLogs) -> str | None:
        """What differs between the step run per micro-batch and on the whole ``batch``, said for
        the user; ``None`` where nothing does, or where the two cannot be compared."""
        output = _joined_output(seen, sizes)
        if output is None:
            return None
        whole_logs = StepLogs()
        before = _random_states()
        try:
            with torch.no_grad(), metrics_kept(steps.module), rng_forked():
                whole = steps.result_of(hook, batch, rest, output, whole_logs, 1.0)
                drew = _random_states() != before
        except Exception:  # noqa: BLE001 - the step on a joined output is ours to try, not the user's to fix
            return None
        if drew:
            return None  # a step that draws random numbers gives other values on every run
        found: list[str] = []
        if hook == "training_step" and whole is not None:
            found += _loss_differs(seen, hook, whole)
        found += _logs_differ(logs, whole_logs)
        found += _results_differ(seen, sizes, hook, whole)
        if not found:
            return None
        return (
            f"{hook} gives other values when it runs once per micro-batch than on the whole batch of {sum(sizes)} "
            f"samples: {'; '.join(found[:4])}. With one process per stage (schedule=...) the step runs on each "
            f"micro-batch ({', '.join(map(str, sizes))} samples) and its values join as a mean over samples (a loss, "
            "a logged value), by their reduce_fx, or row by row; a value computed from the batch as a whole (a loss "
            "normalised by the batch's own weights, a count of its samples, a statistic across samples) cannot "
            "join. Compute it per sample (a mean over samples joins exactly; log a count with reduce_fx='sum'), "
            "return per-sample values, or leave out schedule= to run the step once on the whole batch. "
            "check_batch=False skips this check.")


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _joined_output(seen: MicroBatchesSeen, sizes: list[int]) -> Any | None:
    """The micro-batches' outputs as the whole batch's: tensors on the dim that follows the
    samples, a 0-dim floating-point value (a loss the model computes) weighted as the runtime weighs
    it, anything else the same in each; ``None`` where a leaf does not join so."""
    specs = [spec for _, spec in seen.outputs]
    if any(spec != specs[0] for spec in specs[1:]):
        return None
    joined = []
    for i, parts in enumerate(zip(*(leaves for leaves, _ in seen.outputs))):
        first = parts[0]
        if not isinstance(first, torch.Tensor):
            if any(p != first for p in parts[1:]):
                return None
            joined.append(first)
        elif _is_scalar(first):
            weights = [w[i] for w in seen.weights]
            joined.append(sum(p * w for p, w in zip(parts, weights)) / sum(weights))
        elif first.dim() > 0 and (dim := microbatch.output_batch_dim(list(parts), sizes)) is not None:
            joined.append(torch.cat([p.to(first.device) for p in parts], dim))
        elif all(p.shape == first.shape and torch.equal(p, first) for p in parts[1:]):
            joined.append(first)
        else:
            return None
    return unflatten(joined, specs[0])


def _random_states() -> tuple[Any, ...]:
    """Every generator a step might draw from: torch's (the CPU's and the accelerators' in use),
    Python's and numpy's."""
    states: list[Any] = [bytes(s.numpy()) for s in generator_states()]
    states.append(random.getstate())
    numpy = __import__("sys").modules.get("numpy")
    if numpy is not None:
        state = numpy.random.get_state()
        states.append((state[0], bytes(state[1]), *state[2:]))
    return tuple(states)


def _tolerance(dtype: torch.dtype | None) -> float:
    return ROUNDING.get(dtype, 1e-4) if dtype is not None else 1e-9


def _differs(joined: float, whole: float, dtype: torch.dtype | None) -> bool:
    rtol = _tolerance(dtype)
    return not math.isclose(joined, whole, rel_tol=rtol, abs_tol=rtol * 1e-3)


def _loss_differs(seen: MicroBatchesSeen, hook: str, whole: Any) -> list[str]:
    losses = [loss_of(r, hook) for r in seen.results if r is not None]
    weights = [w for w, r in zip(seen.loss_weights, seen.results) if r is not None]
    if not losses:
        return []
    joined = float(sum(float(v) * w for v, w in zip(losses, weights)) / sum(weights))
    value = loss_of(whole, hook)
    if _differs(joined, float(value), value.dtype):
        return [f"the loss is {joined:.6g} joined over the micro-batches but {float(value):.6g} on the whole batch"]
    return []


def _logs_differ(logs: StepLogs, whole: StepLogs) -> list[str]:
    found = []
    theirs = {name: value for name, value, _ in whole.merged()}
    for name, value, options in logs.merged():
        other = theirs.get(name)
        if isinstance(value, MetricLogged) or other is None or isinstance(other, MetricLogged):
            continue  # a torchmetrics object joins its states exactly
        (joined, dtype), (single, _) = value, other
        kind = options.get("reduce_fx", "mean")
        if _differs(joined, single, getattr(torch, dtype) if dtype else None):
            found.append(f"self.log({name!r}) is {joined:.6g} joined over the micro-batches (reduce_fx="
                         f"{kind if isinstance(kind, str) else getattr(kind, '__name__', kind)!r}) but {single:.6g} "
                         "on the whole batch")
    return found


def _results_differ(seen: MicroBatchesSeen, sizes: list[int], hook: str, whole: Any) -> list[str]:
    results = seen.results
    if hook == "training_step":  # the loss is compared apart; the rest goes to the batch-end hooks
        if not isinstance(whole, dict) or len(whole) < 2:
            return []
        results = [{k: v for k, v in r.items() if k != "loss"} for r in results]
        whole = {k: v for k, v in whole.items() if k != "loss"}
    if whole is None or any(r is None for r in results):
        return []
    try:
        joined = microbatch.join_results(results, sizes)
    except MicroBatchError:
        return []  # refused as the step's result is joined, with its own message
    found = []
    ours, spec = pytree.tree_flatten_with_path(joined)
    theirs, their_spec = pytree.tree_flatten_with_path(whole)
    if spec != their_spec:
        return [f"what {hook} returns has another structure on the whole batch ({their_spec}) than joined ({spec})"]
    for (path, a), (_, b) in zip(ours, theirs):
        where = f"what {hook} returns at {pytree.keystr(path) or '[value]'}"
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                found.append(f"{where} has shape {tuple(a.shape)} joined but {tuple(b.shape)} on the whole batch")
            elif not _tensors_close(a, b.to(a.device)):
                found.append(f"{where} is {_shown(a)} joined over the micro-batches but {_shown(b)} on the whole batch")
        elif not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a != b:
            found.append(f"{where} is {a!r} joined over the micro-batches but {b!r} on the whole batch")
    return found


def _tensors_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    rtol = _tolerance(a.dtype)
    scale = b.abs().max().item() if b.numel() else 0.0
    return torch.allclose(a, b, rtol=rtol, atol=rtol * max(scale, 1e-12))


def _shown(value: torch.Tensor) -> str:
    return f"{value.item():.6g}" if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
