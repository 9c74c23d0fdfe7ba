"""This rank's part of a pipeline that runs one process per stage, and one batch through it.

Every rank holds the plan and its own capture of the module, builds and places its own stages only
(:func:`~.process_stages.rank_flat_stages`), and hands them to torch's schedule. A batch comes
as its micro-batches: the rank holding the first stage gives each micro-batch's call of the module
(its arguments, as the module takes them); the rank holding the last gets each micro-batch's
output back, as the module returns it, and answers that micro-batch's loss. torch back-propagates
the sum of those losses, so the caller weights each loss as it wants the step's loss to count it.

torch's stages learn the shapes that cross each cut on their first step and keep them, so a batch
whose micro-batches differ from the ones seen so far (a last, shorter batch; validation's batches)
runs on stages of its own, made for that shape (``shape`` in :meth:`ProcessPipeline.run`): every
rank derives it from the same batch, so they switch together and none waits for a message of
another shape. The micro-batches of one run have one size; a batch that does not split evenly
runs as one run per size (:func:`equal_runs`), and a count of micro-batches the schedule does not
take runs in GPipe's order (:meth:`~lightning_antichain.plans.process_schedules.ProcessSchedule.fill_drain_order`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..capture import OpGraph
from ..measure.action_clock import ActionClock
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule, fill_drain_runner, run_pre_split
from ..stages.batchnorm import deferred_batch_norm
from ..stages.split import StageModule
from ..weights.initialization import Initializer
from .cut_probe import probed_layouts
from .cut_values import CutLayouts, cut_layouts, registered
from .process_stages import FlatStage, holders, place_rank, schedule_runner, split_for_ranks, torch_stages
from .replication import Regather, Replication, gathered, replicated, resharded
from .tied_parameters import TiedParameters
from .transfer_watch import transfers_watched

#: a micro-batch's loss from its output, as the module returns it, and its index
MicroBatchLoss = Callable[[Any, int], torch.Tensor]


def _tensors_of(stage: StageModule) -> list[torch.Tensor]:
    """The parameters and buffers ``stage`` uses: its own and those of the modules it calls."""
    return [*stage.parameters(), *stage.buffers(), *(b for m in stage.submodules() for b in m.buffers())]


def equal_runs(sizes: list[int], count: int = 1) -> list[range]:
    """The micro-batches of a batch in runs of one size each, in order: torch's stages take one
    shape per run. ``[3, 3, 2, 2]`` runs as ``range(0, 2)`` and ``range(2, 4)``. At least
    ``count`` runs, splitting the longest where there are fewer (replicas of a pipeline run as many
    runs as each other: a replicated stage reduces its gradients in each run's last backward)."""
    runs: list[range] = []
    start = 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or sizes[i] != sizes[start]:
            runs.append(range(start, i))
            start = i
    while len(runs) < count and any(len(run) > 1 for run in runs):
        longest = max(range(len(runs)), key=lambda i: len(runs[i]))
        run = runs[longest]
        half = run.start + len(run) // 2
        runs[longest: longest + 1] = [range(run.start, half), range(half, run.stop)]
    return runs


class ProcessPipeline:
    """Rank ``rank`` of ``ranks``: its stages of ``plan`` under ``schedule``, on ``device``
    (``recompute``: every stage keeps only its inputs and runs its forward again in backward;
    ``deferred_batch_norm``: BatchNorm running statistics from the whole batch, once per step;
    ``replication``: how and over which 1-D mesh of ranks each stage is kept in step with the
    other replicas', :mod:`.replication`, and, with FSDP2, how often a block's parameters are
    gathered, ``regather``; ``compile_arguments``: each stage's graph through ``torch.compile``
    with these). ``rank``, ``ranks`` and ``group`` are the pipeline's: its ranks
    alone."""

    def __init__(self, graph: OpGraph, plan: Plan, schedule: ProcessSchedule, rank: int, ranks: int,
                 device: torch.device, group: Any = None, initializer: Initializer | None = None,
                 recompute: bool = False, deferred_batch_norm: bool = False,
                 replication: tuple[Replication, Any] | None = None,
                 compile_arguments: dict[str, Any] | None = None, regather: Regather = "step",
                 timeout: timedelta | None = None) -> None:
        self.graph, self.plan, self.schedule = graph, plan, schedule
        self.timeout = timeout
        self.rank, self.ranks, self.device, self.group = rank, ranks, device, group
        every = split_for_ranks(graph, plan, schedule, ranks, device)
        #: every stage of the plan (this rank places its own only), to find what crosses each cut
        self.every = every
        params = {id(p): p for stage in every for p in stage.parameters()}
        self._plan_parameters = list(params.values())
        #: the ids of the parameters and buffers any stage of the plan uses, this rank's or another's
        self.staged: frozenset[int] = frozenset(id(t) for stage in every for t in _tensors_of(stage))
        names = {id(p): name for name, p in graph.module.named_parameters()}
        if replication is not None and any(len(r) > 1 for r in holders(every, schedule, ranks).values()):
            raise ValueError("weights tied across the ranks of a pipeline are not kept in step with replicas yet: "
                             "train without replicas, or keep the tie within one stage (colocate_tied=True)")
        self.tied = TiedParameters(holders(every, schedule, ranks), params, names, rank, timeout)
        by_block = replication is not None and replication[0] == "fsdp"
        if by_block and regather == "micro_batch" and schedule.splits_backward:
            raise ValueError(
                f"schedule {schedule.name!r} takes input and weight gradients apart, and FSDP2 reduce-scatters a "
                "block's gradients when its backward reaches the block's inputs, before the weight gradients exist: "
                "gather once per step (regather='step') with it, or choose a schedule that back-propagates whole "
                "(1f1b, interleaved1f1b, gpipe)")
        self.stages: list[FlatStage] = place_rank(every, schedule, rank, ranks, initializer, recompute,
                                                  blocks_of=graph if by_block else None)
        for stage in self.stages:
            stage.stage.compile_arguments = compile_arguments
        self.tied.share_values()
        #: what torch's stages run: each stage, or its replicated wrapper over the other replicas' ranks
        self.modules: list[torch.nn.Module] = list(self.stages)
        #: the parameters FSDP2 replaced by shards, by the id of the one each replaced
        self.replaced: dict[int, torch.nn.Parameter] = {}
        self._sharded = by_block
        if replication is not None:
            for i, stage in enumerate(self.stages):
                blocks = [unit.module for unit in stage.stage.block_units]
                self.modules[i], replaced = replicated(stage, *replication, blocks=blocks, regather=regather)
                self.replaced.update(replaced)
        held = {stage.stage.index: stage.stage for stage in self.stages}
        first, last = held.get(0), held.get(plan.num_stages - 1)
        placeholders = [n.name for n in graph.nodes if n.kind == "placeholder"]
        self._input_slots = None if first is None else [placeholders.index(name) for name in first.inputs]
        self._output_names = None if last is None else last.outputs
        self._runners: dict[Hashable, Any] = {}
        self.deferred_batch_norm = deferred_batch_norm
        self._loss: MicroBatchLoss | None = None
        self._targets: list[torch.Tensor] = []  # one per micro-batch: the loss knows them by identity

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs the first stage, which takes the module's arguments."""
        return self._input_slots is not None

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage, which gives the module's output and the losses."""
        return self._output_names is not None

    def last_rank(self) -> int:
        """The rank that holds the last stage."""
        return self.schedule.rank_of(self.plan.num_stages - 1, self.ranks)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this rank's stages use, each once."""
        return list({id(p): p for stage in self.stages for p in stage.stage.parameters()}.values())

    def owned(self) -> set[int]:
        """The ids of the parameters and buffers this rank's stages use: the ones it trains."""
        return {id(t) for stage in self.stages for t in _tensors_of(stage.stage)}

    def run(self, shape: Hashable, calls: list[tuple[tuple, dict]] | None, loss: MicroBatchLoss,
            chunks: int, train: bool, clock: ActionClock | None = None) -> None:
        """One batch of ``chunks`` micro-batches: forward and backward (``train``) or forward only.

        ``calls`` are the micro-batches' calls of the module where this rank holds the first stage
        (else ``None``); ``loss`` is called on the rank holding the last stage, once per
        micro-batch, in the order the schedule runs them. ``shape`` names the count and shape of
        the micro-batches, the same on every rank (see the module's docstring), and so do which
        parameters need gradients (:meth:`_trainable`). ``clock``: time this step's actions there."""
        if self.holds_first and (calls is None or len(calls) != chunks):
            raise ValueError(f"the rank holding the first stage needs the calls of all {chunks} micro-batches")
        key = (train, shape, self._trainable())
        if key not in self._runners:
            layouts = self._layouts(calls[0] if calls else None, train)
            self._give_layouts(layouts)
            stages = torch_stages(self.stages, self.plan.num_stages, self.device, self.group, self.modules)
            if not self.schedule.takes(chunks, self.ranks):  # a short batch, or the shorter run of an uneven one
                runner = fill_drain_runner(self.schedule, stages, self.ranks, chunks, self._micro_batch_loss, train)
            else:
                runner = schedule_runner(self.schedule, stages, chunks, self._micro_batch_loss)
                if not train and self.schedule.runs_by_table:
                    self.schedule.evaluate_forward_only(runner, self.ranks, chunks)
            tasks = self.schedule.tasks_of(self.rank, self.ranks, chunks, train)  # what a timed-out wait names
            self._runners[key] = runner, stages, layouts, tasks
        runner, stages, layouts, tasks = self._runners[key]
        self._give_layouts(layouts)
        inputs = [self._first_inputs(*call) for call in calls] if calls is not None else None
        self._targets = [torch.tensor(m) for m in range(chunks)]
        targets = self._targets if self.holds_last else None
        self._loss = loss
        watched = transfers_watched(stages, tasks, self.rank, self._global_rank_of, self.plan.num_stages, self.timeout)
        try:
            if train:
                modules = [m for stage in self.stages for m in stage.stage.submodules()]
                with watched, deferred_batch_norm(modules) if self.deferred_batch_norm else contextlib.nullcontext(), \
                        clock.timing(stages) if clock is not None else contextlib.nullcontext():
                    run_pre_split(runner, inputs, targets, train=True)
            else:
                with watched:
                    run_pre_split(runner, inputs, targets, train=False)
                if self._sharded:
                    resharded(self.modules)
        finally:
            self._loss, self._targets = None, []

    def _global_rank_of(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's pipeline."""
        position = self.schedule.rank_of(stage, self.ranks)
        return position if self.group is None else dist.get_global_rank(self.group, position)

    def _trainable(self) -> tuple[bool, ...]:
        """Which of the plan's parameters need gradients now, every rank's alike: which values
        crossing a cut need a gradient follows from it, and torch's stages are made for that (a
        layer unfrozen mid-fit, as Lightning's ``BaseFinetuning`` does, needs its gradient sent)."""
        return tuple(p.requires_grad for p in self._plan_parameters)

    def _layouts(self, call: tuple[tuple, dict] | None, train: bool) -> CutLayouts:
        """What crosses each cut for micro-batches like ``call`` (given on the rank of the first
        stage): found there on fake tensors and sent to the pipeline's other ranks
        (:mod:`.cut_values`), or, where the stages read values that fake tensors do not have,
        from one real forward of ``call`` through the ranks (:mod:`.cut_probe`)."""
        found: CutLayouts | None = None
        if call is not None:
            try:
                found = cut_layouts(self.every, self._values_of(*call), self.device, train,
                                    self.schedule.splits_backward)
            except Exception:  # noqa: BLE001 - an operation that reads values (.item(), nonzero): probe instead
                found = None
        sent = [found]
        dist.broadcast_object_list(sent, group_src=self.schedule.rank_of(0, self.ranks), group=self.group)
        if sent[0] is not None:
            return registered(sent[0])
        with gathered(self.modules):  # FSDP2's shards whole (a stage at once), for stages run outside its hooks
            return probed_layouts(self.every, self.schedule, self.rank, self.ranks,
                                  None if call is None else self._values_of(*call), self.device, train, self.group,
                                  self.schedule.splits_backward)

    def _give_layouts(self, layouts: CutLayouts) -> None:
        for stage in self.stages:
            k = stage.stage.index
            stage.layouts = layouts.cuts[k], layouts.cuts[k + 1]
            stage.whole_backward = k in layouts.whole_backward

    def _values_of(self, args: tuple, kwargs: dict) -> tuple:
        """The first stage's arguments for a call of the module: its values crossing the first cut."""
        assert self._input_slots is not None
        values = self.graph.bind(args, kwargs)
        return tuple(values[i] for i in self._input_slots)

    def _first_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """What torch's first stage takes for a call of the module: the values crossing the first
        cut, as :meth:`_values_of` gives them, carried as its layout says."""
        values = self._values_of(args, kwargs)
        first = next(stage for stage in self.stages if stage.stage.index == 0)
        return values if first.layouts is None else first.layouts[0].pack(values, self.device, "the module's call")

    def _micro_batch_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None and self._output_names is not None and self.graph.signature is not None
        leaves = output if isinstance(output, tuple) else (output,)
        last = next(stage for stage in self.stages if stage.stage.index == self.plan.num_stages - 1)
        if last.layouts is not None:
            leaves = last.layouts[1].unpack(leaves)
        micro_batch = next((m for m, t in enumerate(self._targets) if t is target), None)
        if micro_batch is None:
            # torch's first step infers the gradients' shapes from a forward and backward of
            # made-up values: the user's step must not see them
            return sum((v * 0).sum() for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad) + (
                torch.zeros((), device=self.device, requires_grad=True))
        returned = self.graph.signature.assemble(dict(zip(self._output_names, leaves)))
        return self._loss(returned, micro_batch)
