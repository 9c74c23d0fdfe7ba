"""This rank's stages and the steps they run: the batch's micro-batches through the pipeline, and
what the step answers Lightning, the same on every rank.

A step splits this rank's replica's share of the batch into micro-batches; the user's step hook
runs once per micro-batch on the last stage's rank (:mod:`.micro_batch_steps`); the step's loss is
the mean of the micro-batches' losses, weighted by their samples (or by the label tokens a Hugging
Face model's loss counts), and what the step logs is merged (:mod:`.step_logs`); the last stage's
rank sends both to the others of its pipeline, and where there are replicas, the replicas' shares
are joined into the whole batch's. The step's gradients wait aside until Lightning's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches import microbatch
from ..batches.batch_dependence import BatchDependenceError
from ..batches.model_loss import counted_items
from ..capture.pytrees import flatten, map_tensors
from ..lightning.runtime import Host
from ..planner.process_calibration import StepCalibration, from_records
from ..plans.layout import Layout
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule
from ..torch_private import pytree
from .micro_batch_steps import MicroBatchSteps, refuse_whole_batch_arguments
from .process_pipeline import ProcessPipeline, equal_runs
from .rank_holdings import everyone
from .same_batches import StepAgreement, agree_on_step
from .small_broadcast import broadcast_object
from .step_logs import StepLogs, StepValues, averaged_logs, metric_states, replay, set_metric_states, set_step_values
from .step_loss import loss_of
from .whole_batch_check import WholeBatchCheck

TRAINING = "training_step"


class RankRun:
    """This rank's ``pipeline`` of ``plan`` in ``layout`` on ``mesh`` under ``schedule``, and the
    steps it runs (see the module's docstring). ``searched``: the planner chose the layout, so
    every rank loads the whole batch and takes its replica's share; else each replica loads its
    own. ``calibration``: times the first training steps' actions, until the plan takes its stage
    times from them."""

    def __init__(self, strategy: Host, steps: MicroBatchSteps, pipeline: ProcessPipeline, plan: Plan,
                 schedule: ProcessSchedule, layout: Layout, mesh: Any, searched: bool,
                 calibration: StepCalibration | None, counts_items: bool, whole_batch: WholeBatchCheck) -> None:
        self.strategy = strategy
        self.steps = steps
        self.pipeline = pipeline
        self.plan = plan
        self.schedule = schedule
        self.layout = layout
        self.mesh = mesh
        self.searched = searched
        self.calibration = calibration
        #: whether the module computes a loss over label tokens (a Hugging Face model given labels=)
        self.counts_items = counts_items
        #: the step kinds whose first step is still to be checked on samples taken together
        self.whole_batch = whole_batch
        self._stashed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        #: each metric's value for the whole batch of a step (what Lightning logs on_step)
        self._step_values = StepValues()

    def step(self, hook: str, target: nn.Module, batch: Any, rest: tuple, accumulate: int) -> Any:
        """The step ``hook`` of the whole ``batch``: the step's loss on every rank for training, the
        batch's predictions for prediction, else ``None``."""
        steps = self.steps
        share = replica_share(batch, self.layout, self.strategy.global_rank, self.searched)
        micro = microbatch.scatter(share, self.plan.chunks, lists=True)
        sizes = [microbatch.batch_size(m) or 0 for m in micro]
        calls = [steps.call_of(hook, m, rest) for m in micro] if self.pipeline.holds_first else None
        for call, samples in zip(calls or (), sizes):
            if call is not None:
                refuse_whole_batch_arguments(target, steps.describe, hook, call, samples,
                                             self.strategy.options.batch_dim)
        counted = [c for c in calls or () if c is not None] if self.counts_items else []
        agreement = agree(self.strategy, share, self.layout, sum(sizes), None if calls is None else sum(
            c is not None for c in calls) / len(calls), float(sum(counted_items(target, *c) for c in counted))
            if counted else None)
        if agreement.called is not None and agreement.called < 1:
            if agreement.called == 0 and hook != TRAINING:
                return None  # an evaluation step that returned None before calling the module: skipped
            called = sum(c is not None for c in calls) if calls is not None else 0
            raise RuntimeError(skipped_message(hook, called, len(micro)))
        return self._run(hook, share, micro, sizes, calls, rest, accumulate, agreement)

    def _run(self, hook: str, batch: Any, micro: list[Any], sizes: list[int], calls: list[Any] | None, rest: tuple,
             accumulate: int, agreement: StepAgreement) -> Any:
        """Run the micro-batches ``micro`` of ``sizes`` samples (this replica's ``batch``) through
        the pipeline, the step ``hook`` answering each one's output on the last stage's rank; what
        every rank returns to Lightning (see :meth:`step`). ``agreement``: what every rank knows of
        the step."""
        module, pipeline, device = self.steps.module, self.pipeline, self.strategy.root_device
        shares = self._shares(sizes, agreement)
        logs = StepLogs()
        seen = self.whole_batch.watch(hook) if pipeline.holds_last else None
        losses: list[torch.Tensor] = []  # weighted as the schedule back-propagates them, read once after
        train = hook == TRAINING
        results: list[Any] = [None] * len(micro)
        skipped: list[bool] = [False] * len(micro)

        def loss(output: Any, m: int) -> torch.Tensor:
            share = shares(output, m)
            result = self.steps.result_of(hook, micro[m], rest, output, logs, share)
            if seen is not None:
                seen.keep(m, output, share)
            if train and result is None:  # skipped after the module's call: no gradient from it
                skipped[m] = True
                return zero_loss(output, device)
            if not train:
                results[m] = map_tensors(lambda t: t.detach().cpu(), result)
                return torch.zeros((), device=device)
            value = loss_of(result, hook)
            weighted = value * share(value)
            losses.append(weighted.detach())
            if isinstance(result, dict) and len(result) > 1:  # what else it returns goes to the batch-end hooks
                results[m] = map_tensors(lambda t: t.detach().cpu(), {k: v for k, v in result.items() if k != "loss"})
            return weighted / accumulate

        every = [len(equal_runs(microbatch.split_sizes(n, self.plan.chunks))) for n in agreement.samples]
        runs = equal_runs(sizes, max(every))  # as many as every replica's: each run's last backward reduces
        calibration = self.calibration if train and len(runs) == 1 and len(micro) == self.plan.chunks else None
        with torch.enable_grad() if train else torch.no_grad(), \
                self._gradients_stashed(pipeline.parameters()) if train else nullcontext(), \
                self._step_values.watching(module) if pipeline.holds_last else nullcontext(), \
                calibration.timing(device) if calibration is not None else nullcontext() as clock:
            for run in runs:
                pipeline.run(shape_of(micro[run.start:run.stop]), None if calls is None else calls[run.start:run.stop],
                             lambda output, m, start=run.start: loss(output, start + m), len(run), train, clock=clock)
            if train:
                pipeline.tied.sum_gradients()
        if calibration is not None and calibration.done:
            self._calibrated(calibration)
        mean = float(torch.stack(losses).sum()) if losses else 0.0
        problem = None if seen is None else WholeBatchCheck.problem(seen, self.steps, hook, batch, micro, rest, sizes)
        sent = (mean, logs.merged(), metric_states(module), self._step_values.values(), results, skipped, problem
                ) if pipeline.holds_last else None
        mean, merged, states, values, results, skipped, problem = broadcast_object(
            sent, pipeline.last_rank(), self.pipeline_group(), device)
        if any(skipped):
            self._stashed = []
            raise RuntimeError(skipped_message(hook, len(skipped) - sum(skipped), len(skipped)))
        if not pipeline.holds_last:
            set_metric_states(module, states)
        set_step_values(module, values)
        if self.layout.dp > 1:  # the whole batch's, from every replica's share
            mean, merged, results, sizes, problem = self._over_replicas(mean, merged, results, sizes, agreement,
                                                                        problem)
        if problem is not None:
            self._stashed = []
            raise BatchDependenceError(problem)
        replay(module, merged, sum(agreement.samples), device)
        joined = None if all(r is None for r in results) else microbatch.join_results(results, sizes)
        joined = map_tensors(lambda t: t.to(device), joined)
        if not train:
            return joined
        loss_value = torch.tensor(mean, device=device)
        return loss_value if joined is None else {"loss": loss_value, **joined}

    def _shares(self, sizes: list[int], agreement: StepAgreement) -> Callable[[Any, int], Callable[[Any], float]]:
        """For a micro-batch's output and index, the share of the whole batch that a value its step
        computes has, where the values of the micro-batches join as their weighted sum: its share
        of the step's samples, or, for the loss a Hugging Face model computes from ``labels=`` (a
        mean over the label tokens that count), its share of those tokens, as the in-process
        runtime joins it (:mod:`~lightning_antichain.batches.model_loss`). Replicas' shares count
        ``dp`` times: their gradients are averaged over the replicas."""
        steps, target, dp = self.steps, self.strategy.target(), len(agreement.samples)
        samples, items = sum(agreement.samples), None if agreement.items is None else sum(agreement.items)

        def of(output: Any, m: int) -> Callable[[Any], float]:
            model_loss = _model_loss(output) if items is not None else None

            def share(value: Any) -> float:
                if model_loss is not None and value is model_loss and steps.given_call is not None:
                    return dp * float(counted_items(target, *steps.given_call)) / max(float(items), 1.0)
                return dp * sizes[m] / samples

            return share

        return of

    def _over_replicas(self, mean: float, merged: list, results: list, sizes: list[int], agreement: StepAgreement,
                       problem: str | None) -> tuple[float, list, list, list[int], str | None]:
        """The step's loss, logs and predictions over every replica's share: the loss the mean of
        theirs (each weighted by its share already), the logs reduced over the shares, the
        predictions in the batch's order, with every micro-batch's samples; and the first replica's
        problem with its step's values, if any (:mod:`.whole_batch_check`)."""
        shares = everyone((mean, merged, results, sizes, problem), self.replicas_group())
        mean = sum(share[0] for share in shares) / len(shares)
        merged = averaged_logs([share[1] for share in shares], list(agreement.samples))
        problem = next((share[4] for share in shares if share[4] is not None), None)
        return (mean, merged, [r for share in shares for r in share[2]], [n for share in shares for n in share[3]],
                problem)

    def _calibrated(self, calibration: StepCalibration) -> None:
        """Take the plan's stage times from every rank's timed actions (every rank calls it at the
        same step), and say how the prediction moved."""
        layout = self.layout
        table = self.schedule.table(layout.pp, self.plan.chunks)
        records = everyone(calibration.record())
        first = [records[rank] for rank in layout.pipeline(0)]  # every replica takes the first one's plan
        self.plan = self.pipeline.plan = from_records(self.plan, table, first)
        self.calibration = None
        found = self.plan.calibration or {}
        optimizer = self.plan.optimizer_step_s  # predicted, not in the steps timed
        rank_zero_info(f"{self.schedule.name} on {layout.pp} processes, timed over {found.get('steps')} "
                       f"steps: the schedule's tasks predicted {1e3 * (self.plan.predicted_step_s - optimizer):.1f} "
                       f"ms (from the profile: {1e3 * (found.get('profiled_step_s', 0.0) - optimizer):.1f} ms), "
                       f"measured {1e3 * found.get('measured_step_s', 0.0):.1f} ms; with the optimizer's step, "
                       f"predicted {1e3 * self.plan.predicted_step_s:.1f} ms")

    @contextmanager
    def _gradients_stashed(self, params: list[torch.nn.Parameter]) -> Generator[None, None, None]:
        """The step's gradients wait aside until :meth:`give_gradients`: Lightning clears the
        gradients between the training step and the backward, and the schedule ran both."""
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
            self._stashed = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for p, grad in zip(params, before):
                p.grad = grad

    def give_gradients(self) -> None:
        """Add the last training step's gradients to the parameters' (Lightning's backward)."""
        stashed, self._stashed = self._stashed, []
        for p, grad in stashed:
            p.grad = grad if p.grad is None else p.grad + grad

    def pipeline_group(self) -> Any:
        return pipeline_group(self.layout, self.mesh)

    def replicas_group(self) -> Any:
        return replicas_group(self.layout, self.mesh)


def pipeline_group(layout: Layout, mesh: Any) -> Any:
    """The process group of this rank's pipeline in ``layout`` on ``mesh`` (``None``, the world,
    where there is one pipeline)."""
    return None if layout.dp == 1 else mesh["pp"].get_group()


def replicas_group(layout: Layout, mesh: Any) -> Any:
    """The process group of this rank's stages' replicas in ``layout`` on ``mesh`` (``None`` where
    there are none)."""
    return None if layout.dp == 1 else mesh["dp"].get_group()


def replica_share(batch: Any, layout: Layout, rank: int, searched: bool) -> Any:
    """Rank ``rank``'s replica's part of the whole ``batch`` in ``layout``: all of it where there
    is one replica, or where each replica loads only its share (a layout given, not ``searched``)."""
    if layout.dp == 1 or not searched:
        return batch
    shares = microbatch.scatter(batch, layout.dp, lists=True)
    sizes = [microbatch.batch_size(share) or 0 for share in shares]
    if len(shares) != layout.dp or len(set(sizes)) > 1:
        raise ValueError(
            f"a batch of {sum(sizes)} samples splits over the {layout.dp} pipeline replicas into shares of {sizes} "
            f"samples; every replica needs an equal share. Make the batch size a multiple of {layout.dp} x chunks, "
            "and set drop_last=True in the DataLoader where the last batch is shorter.")
    return shares[layout.replica(rank)]


def agree(strategy: Host, batch: Any, layout: Layout, samples: int, called: float | None = None,
          items: float | None = None) -> StepAgreement:
    """:func:`~.same_batches.agree_on_step` for this rank's replica in ``layout``."""
    return agree_on_step(batch, strategy.root_device, layout.dp, layout.replica(strategy.global_rank), samples,
                         called, items)


def shape_of(micro: list[Any]) -> tuple:
    """What the stages' shapes follow from: the micro-batches' tensor shapes and dtypes."""
    leaves, _ = flatten(micro[0])
    return len(micro), tuple((tuple(v.shape), v.dtype) for v in leaves if isinstance(v, torch.Tensor))


def _model_loss(output: Any) -> Any:
    """The loss a model's output holds (a Hugging Face ``ModelOutput``'s ``loss``), or ``None``."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def zero_loss(output: Any, device: torch.device) -> torch.Tensor:
    """A loss of 0 that reaches every output that needs a gradient: the schedule runs the backward
    of a micro-batch whose step returned ``None`` too, and it must give no gradient."""
    leaves = [v for v in pytree.tree_leaves(output) if isinstance(v, torch.Tensor) and v.requires_grad]
    return sum(((v * 0).sum() for v in leaves), torch.zeros((), device=device, requires_grad=True))


def skipped_message(hook: str, called: int, count: int) -> str:
    part = "" if called == 0 else f" for {count - called} of its {count} micro-batches"
    return (f"{hook} returned None to skip this batch{part}. With schedule=, every stage is a process, and Lightning "
            "skips no batch in a run of several processes (it refuses the same under DDP). Leave out schedule= (one "
            "process drives the stages and skips as plain Lightning does), or train on every batch: filter the data "
            "in the DataLoader instead, or return a loss of 0 (an optimizer with momentum still moves the weights).")
