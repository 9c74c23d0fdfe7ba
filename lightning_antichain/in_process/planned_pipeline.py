"""The plan and the Pipeline of the module a strategy pipelines, from its first batch to teardown.

The strategy decides *when* (setup, the first forward, teardown); this decides *what*: profile and
plan on the first batch it sees (or ``example_input_array``), with rank 0's plan sent to every
replica; plan again when training's batches are of another size than the plan was made for (the
example or a sanity-check batch may come first); plan afresh for another module (``fit(a)`` then
``validate(b)``); and refuse, before any work, a first training batch the plan cannot run.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches.batch_dependence import refuse_per_sample_lists
from ..batches.batch_dims import batch_size_of
from ..capture import OpGraph
from ..capture.pytrees import map_tensors
from ..lightning.runtime import Host, rank_zeros_plan
from ..planner.planning import AUTO
from ..planner.prediction_check import PredictionCheck
from ..planner.public import planned_for_call, planning_call
from ..plans.options import PipelineOptions
from ..plans.plan import Plan
from ..weights.materialize import has_meta_state
from .budget import check_budgets
from .pipeline import Pipeline


class PlannedPipeline:
    """The plan (loaded from ``plan_path``, or made on the first batch) and the Pipeline running it."""

    def __init__(self, strategy: Host) -> None:
        self.strategy = strategy
        self.plan: Plan | None = None
        self.pipeline: Pipeline | None = None
        self.prediction_check: PredictionCheck | None = None
        self._planned_for: weakref.ref[nn.Module] | None = None  # the module the plan was made for
        self._graph: OpGraph | None = None  # the graph profiled for the plan, run by the pipeline
        self._checked_batch = False
        self._checked_lists = False

    @property
    def options(self) -> PipelineOptions:
        return self.strategy.options

    @property
    def plan_path(self) -> str | None:
        return self.strategy.plan_path

    def build(self, target: nn.Module, args: tuple, kwargs: dict) -> Pipeline:
        """Profile one micro-batch ``args, kwargs`` (or load its cached profile), plan, place the stages."""
        strategy = self.strategy
        planned_for = self._planned_for() if self._planned_for is not None else None
        if self.plan is not None and self.plan_path is None and planned_for is not target:
            self.plan, self._graph = None, None  # fit(a) then validate(b): b gets its own plan
        if self.plan is None:
            self.plan = rank_zeros_plan(lambda: self._make_plan(target, args, kwargs), strategy,
                                        shared=strategy.is_distributed)  # every replica runs rank 0's plan
            self._planned_for = weakref.ref(target)
            rank_zero_info(self.plan.table())
        graph = self._graph if self._graph is not None and self._graph.module is target else None
        calibrated = self.plan.calibration is not None and strategy.is_global_zero
        self.prediction_check = PredictionCheck(self.plan, self.plan_path) if calibrated else None
        budgeted = any(stage.memory_limit_bytes is not None for stage in self.plan.stages)
        checked = graph is not None and not has_meta_state(target)  # planning ran the batch check on real values
        self.pipeline = Pipeline(
            target,
            self.plan,
            self.options.replace(chunks=self.plan.chunks, check_batch=self.options.check_batch and not checked,
                                 measure_activations=self.options.measure_activations or budgeted),
            graph=graph,  # the graph planning captured and checked, if it is of this module
            devices=strategy.stage_devices,
            output_device=strategy.root_device,
        )
        strategy.stages_placed()
        return self.pipeline

    def _make_plan(self, target: nn.Module, args: tuple, kwargs: dict) -> Plan:
        with torch.inference_mode(False), torch.enable_grad():
            example = map_tensors(torch.Tensor.clone, (args, kwargs))  # ordinary tensors, even from inference mode
            planned = planned_for_call(target, *example, self.strategy.stage_devices, self.options,
                                       self.strategy.optimizers)
        self._graph = planned.graph
        if planned.cached_from is not None:
            rank_zero_info(f"lightning-antichain: using the cached profile {planned.cached_from}")
        return planned.plan

    def forward(self, target: nn.Module, args: tuple, kwargs: dict, training_step: bool) -> Any:
        """``target``'s pipelined forward of one call: checked, planned and built on first use."""
        options = self.options
        if options.check_batch and not self._checked_lists:
            self._checked_lists = True
            refuse_per_sample_lists(target, args, kwargs, options.batch_dim)
        if training_step and not self._checked_batch:
            self._checked_batch = True
            self._check_first_batch(batch_size_of(target, args, kwargs, options.batch_dim))
        if self.pipeline is None:  # auto weighs how to split the whole batch; else its first micro-batch
            self.build(target, *planning_call(target, args, kwargs, options))
        assert self.pipeline is not None
        return self.pipeline(*args, **kwargs)

    def _check_first_batch(self, size: int | None) -> None:
        if size == 0:
            raise ValueError(
                "the first training batch is empty (0 samples). Check the DataLoader: the dataset's length, "
                "its sampler, and drop_last."
            )
        if size is not None and self.options.chunks != AUTO and size < self.options.chunks:
            raise ValueError(
                f"chunks={self.options.chunks} is larger than the batch of {size} samples; lower chunks or raise "
                "the batch size (a shorter last batch of an epoch is fine)"
            )
        if size is not None:
            self._plan_for_batch(size)

    def _plan_for_batch(self, size: int) -> None:
        """Plan again if the plan was made for batches (or micro-batches) of another size than training's.

        The example (``example_input_array``) or a sanity-check validation batch may arrive first
        with another size; a plan made for it would predict the wrong times and, worse, check the
        memory limits against activations of the wrong size.
        """
        if self.plan is None or self.plan_path is not None or self.pipeline is None:
            return
        if self.options.chunks == AUTO:
            planned, wanted, what = self.plan.batch_size, size, "batches"
        else:
            planned, wanted, what = self.plan.micro_batch_size, -(-size // self.options.chunks), "micro-batches"
        if planned in (None, wanted):
            return
        rank_zero_info(
            f"lightning-antichain: the plan was made for {what} of {planned} samples, training runs "
            f"{what} of {wanted}; profiling and planning again"
        )
        self.close()
        self.plan, self._graph, self.prediction_check = None, None, None

    def check_budgets(self) -> None:
        """After an optimizer step: refuse a stage that held more than its memory budget
        (:mod:`~lightning_antichain.in_process.budget`)."""
        pipeline = self.pipeline
        if pipeline is None or self.plan is None or not pipeline.measured_a_step:
            return
        check_budgets(self.plan, pipeline.stages, pipeline.last_activation_bytes, self.strategy.optimizers)

    def close(self) -> None:
        """Stop the Pipeline's workers and drop it; the plan is kept for the next run."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

