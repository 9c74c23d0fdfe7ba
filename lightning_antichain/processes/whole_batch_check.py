"""The first step of each kind run once more on two micro-batches taken together, so that a value
the step computes from its batch as a whole is found, not joined from the micro-batches' silently.

With one process per stage the user's step runs once per micro-batch, and what it gives joins: the
loss and logged values by their samples (or ``reduce_fx``), returned tensors by their rows. That is
the whole batch's value only where the step computes per sample. A loss normalised inside the step
by the batch's own weights (``(w * losses).sum() / w.sum()``), a count of the batch's samples, a
statistic across samples: each comes out as the micro-batches', and trains or reports something
else than plain Lightning. At the first step of each kind (training, validation, test, predict),
the last stage's rank keeps the module's output for the first two micro-batches, joins them (the
forward is per sample: the batch-dependence check saw to it), and runs the step three times more:
on each of the two, and on their samples together with the joined output standing for the
module's. The loss, each logged value and each returned value of the pair must join into what the
two together give; where one does not, beyond the rounding of its dtype, every rank stops with a
:class:`~..batches.batch_dependence.BatchDependenceError` naming it. Two micro-batches show any such
dependence and keep the memory the check holds to two outputs (a language model's logits are the
largest thing a stage makes). The extra runs' logs and torchmetrics updates are dropped and their
random draws undone; a step that draws random numbers (its values differ from run to run) is not
compared, nor is one whose output does not join exactly. ``check_batch=False`` turns it off.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..batches import microbatch
from ..batches.microbatch import MicroBatchError
from ..capture.pytrees import flatten, unflatten
from ..device import generator_states, rng_forked
from ..torch_private import pytree
from .micro_batch_steps import MicroBatchSteps
from .step_logs import MetricLogged, StepLogs, metrics_kept
from .step_loss import first_samples, loss_of

HOOKS = ("training_step", "validation_step", "test_step", "predict_step")
KEPT = 2
"""The micro-batches whose outputs the check keeps and runs together."""

#: how far apart a value joined from micro-batches and the same samples' together may be, relative
#: to its size, by dtype: sums in another order round differently, more in a narrow dtype
ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass
class MicroBatchesSeen:
    """The module's output for each of the first micro-batches of one step on the last stage's
    rank (detached), with the weight the runtime gives a value of it in the whole batch's."""

    outputs: dict[int, Any] = field(default_factory=dict)
    shares: dict[int, Callable[[Any], float]] = field(default_factory=dict)

    def keep(self, m: int, output: Any, share: Callable[[Any], float]) -> None:
        if m < KEPT:
            self.outputs[m] = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, output)
            self.shares[m] = _share_of_detached(output, self.outputs[m], share)


class WholeBatchCheck:
    """Which step kinds are still to be checked, and the check of one (module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self._pending = set(HOOKS) if enabled else set()

    def watch(self, hook: str) -> MicroBatchesSeen | None:
        """A record to keep this step's first micro-batches in, where ``hook`` is still to be checked."""
        if hook not in self._pending:
            return None
        self._pending.discard(hook)
        return MicroBatchesSeen()

    @staticmethod
    def problem(seen: MicroBatchesSeen, steps: MicroBatchSteps, hook: str, batch: Any, micro: list[Any],
                rest: tuple, sizes: list[int]) -> str | None:
        """What differs between the step run on each of the first two micro-batches and on their
        samples together, said for the user; ``None`` where nothing does, or where the two cannot
        be compared."""
        if len(seen.outputs) < KEPT:
            return None
        pair = sizes[:KEPT]
        output = _joined_output([seen.outputs[m] for m in range(KEPT)], [seen.shares[m] for m in range(KEPT)], pair)
        together = first_samples(batch, microbatch.batch_size(batch), sum(pair))
        if output is None or together is None:
            return None
        before = _random_states()
        apart_logs, together_logs = StepLogs(), StepLogs()
        try:
            with torch.no_grad(), metrics_kept(steps.module), rng_forked():
                apart = [steps.result_of(hook, micro[m], rest, seen.outputs[m], apart_logs, seen.shares[m])
                         for m in range(KEPT)]
                whole = steps.result_of(hook, together, rest, output, together_logs, 1.0)
                drew = _random_states() != before
        except Exception:  # noqa: BLE001 - the step on a joined output is ours to try, not the user's to fix
            return None
        if drew or any(r is None for r in apart) or whole is None:
            return None  # random values differ from run to run; a step that skips gives nothing to compare
        found: list[str] = []
        if hook == "training_step":
            found += _loss_differs(apart, [seen.shares[m] for m in range(KEPT)], hook, whole)
        found += _logs_differ(apart_logs, together_logs)
        found += _results_differ(apart, pair, hook, whole)
        if not found:
            return None
        return (
            f"{hook} gives other values when it runs once per micro-batch than on the same samples together (its "
            f"first two micro-batches, {pair[0]} and {pair[1]} samples): {'; '.join(found[:4])}. With one process "
            "per stage (schedule=...) the step runs on each micro-batch and its values join as a mean over samples "
            "(a loss, a logged value), by their reduce_fx, or row by row; a value computed from the batch as a "
            "whole (a loss normalised by the batch's own weights, a count of its samples, a statistic across "
            "samples) cannot join. Compute it per sample (a mean over samples joins exactly; log a count with "
            "reduce_fx='sum'), return per-sample values, or leave out schedule= to run the step once on the whole "
            "batch. check_batch=False skips this check.")


def _share_of_detached(output: Any, detached: Any, share: Callable[[Any], float]) -> Callable[[Any], float]:
    """``share`` (which knows a model's own loss by identity in ``output``) for values of
    ``detached``, computed now: the kept output holds no reference to ``output``'s graph."""
    shares = {id(d): share(o) for o, d in zip(pytree.tree_leaves(output), pytree.tree_leaves(detached))
              if isinstance(o, torch.Tensor)}
    samples = share(None)
    return lambda value: shares.get(id(value), samples)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _joined_output(outputs: list[Any], shares: list[Callable[[Any], float]], sizes: list[int]) -> Any | None:
    """The micro-batches' outputs as their samples' together: tensors on the dim that follows the
    samples, a 0-dim floating-point value (a loss the model computes) weighted as the runtime weighs
    it, anything else the same in each; ``None`` where a leaf does not join so."""
    flat = [flatten(o) for o in outputs]
    specs = [spec for _, spec in flat]
    if any(spec != specs[0] for spec in specs[1:]):
        return None
    joined = []
    for parts in zip(*(leaves for leaves, _ in flat)):
        first = parts[0]
        if not isinstance(first, torch.Tensor):
            if any(p != first for p in parts[1:]):
                return None
            joined.append(first)
        elif _is_scalar(first):
            weights = [share(p) for share, p in zip(shares, parts)]
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
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state = numpy.random.get_state()
        states.append((state[0], bytes(state[1]), *state[2:]))
    return tuple(states)


def _tolerance(dtype: torch.dtype | None) -> float:
    return ROUNDING.get(dtype, 1e-4) if dtype is not None else 1e-9


def _differs(joined: float, whole: float, dtype: torch.dtype | None) -> bool:
    rtol = _tolerance(dtype)
    return not math.isclose(joined, whole, rel_tol=rtol, abs_tol=rtol * 1e-3)


def _loss_differs(apart: list[Any], shares: list[Callable[[Any], float]], hook: str, whole: Any) -> list[str]:
    losses = [loss_of(r, hook) for r in apart]
    weights = [share(v) for share, v in zip(shares, losses)]
    joined = float(sum(float(v) * w for v, w in zip(losses, weights)) / sum(weights))
    value = loss_of(whole, hook)
    if _differs(joined, float(value), value.dtype):
        return [f"the loss is {joined:.6g} joined over the micro-batches but {float(value):.6g} on them together"]
    return []


def _logs_differ(apart: StepLogs, together: StepLogs) -> list[str]:
    found = []
    theirs = {name: value for name, value, _ in together.merged()}
    for name, value, options in apart.merged():
        other = theirs.get(name)
        if isinstance(value, MetricLogged) or other is None or isinstance(other, MetricLogged):
            continue  # a torchmetrics object joins its states exactly
        (joined, dtype), (single, _) = value, other
        kind = options.get("reduce_fx", "mean")
        if _differs(joined, single, getattr(torch, dtype) if dtype else None):
            found.append(f"self.log({name!r}) is {joined:.6g} joined over the micro-batches (reduce_fx="
                         f"{kind if isinstance(kind, str) else getattr(kind, '__name__', kind)!r}) but {single:.6g} "
                         "on them together")
    return found


def _results_differ(apart: list[Any], sizes: list[int], hook: str, whole: Any) -> list[str]:
    if hook == "training_step":  # the loss is compared apart; the rest goes to the batch-end hooks
        if not isinstance(whole, dict) or len(whole) < 2:
            return []
        apart = [{k: v for k, v in r.items() if k != "loss"} for r in apart]
        whole = {k: v for k, v in whole.items() if k != "loss"}
    try:
        joined = microbatch.join_results(apart, sizes)
    except MicroBatchError:
        return []  # refused as the step's result is joined, with its own message
    ours, spec = pytree.tree_flatten_with_path(joined)
    theirs, their_spec = pytree.tree_flatten_with_path(whole)
    if spec != their_spec:
        return [f"what {hook} returns has another structure on the samples together ({their_spec}) than joined "
                f"({spec})"]
    found = []
    for (path, a), (_, b) in zip(ours, theirs):
        where = f"what {hook} returns at {pytree.keystr(path) or '[value]'}"
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                found.append(f"{where} has shape {tuple(a.shape)} joined but {tuple(b.shape)} on them together")
            elif not _tensors_close(a, b.to(a.device)):
                found.append(f"{where} is {_shown(a)} joined over the micro-batches but {_shown(b)} on them together")
        elif not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a != b:
            found.append(f"{where} is {a!r} joined over the micro-batches but {b!r} on them together")
    return found


def _tensors_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    rtol = _tolerance(a.dtype)
    scale = b.abs().max().item() if b.numel() else 0.0
    return torch.allclose(a, b, rtol=rtol, atol=rtol * max(scale, 1e-12))


def _shown(value: torch.Tensor) -> str:
    return f"{value.item():.6g}" if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
