"""The strategy's runtime when one process drives every stage of its pipeline (the default).

The pipelined module's forward becomes the Pipeline's (planned on the first batch, or on
``example_input_array``): the user's step runs once per batch on the joined output, and
Lightning's backward enters the stages' backward. Replicas (one such process each) keep each
stage in step with torch's DDP, which reduces during the stage's last backward
(:mod:`~lightning_antichain.in_process.stage_reduction`); after the optimizer step, a stage that held
more than its memory budget is refused.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from ..capture.signature import split_inputs
from ..lightning.forward_patch import ForwardPatch
from ..lightning.runtime import Holdings, Host, Ranks, Runtime
from ..plans.plan import Plan
from ..weights.optimizer_state import state_with_parameters
from .pipeline import Pipeline
from .planned_pipeline import PlannedPipeline
from .stage_reduction import StageReduction, average_gradients

TRAINING = "training_step"


class InProcessRuntime(Runtime):
    """One Pipeline per process, its stages in worker threads (see the module's docstring)."""

    def __init__(self, strategy: Host, log_stage_times: bool) -> None:
        super().__init__(strategy, InProcessRanks(strategy), Holdings())
        self.planned = PlannedPipeline(strategy)
        self.log_stage_times = log_stage_times
        self.tasks_before: Counter[tuple[int, int]] = Counter()
        self._forward_patch = ForwardPatch()
        self._calls = 0
        self._checked_first_step = False
        self._in_training_step = False
        self._leftovers_placed = False
        self._stage_groups: list[Any] = []  # a process group over the replicas per stage

    @property
    def plan(self) -> Plan | None:
        return self.planned.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self.planned.plan = plan

    @property
    def pipeline(self) -> Pipeline | None:
        return self.planned.pipeline

    @property
    def tasks_run(self) -> Counter[tuple[int, int]]:
        """Micro-batch tasks run, by stage and worker thread, over every run so far."""
        current = self.pipeline.tasks_run if self.pipeline is not None else Counter()
        return self.tasks_before + current

    def setup(self, trainer: Any) -> None:
        """Build on ``example_input_array`` where the module has one; make the forward the pipeline's."""
        strategy = self.strategy
        example = getattr(strategy.lightning_module, "example_input_array", None)
        if example is not None and strategy.module_path is None and self.pipeline is None:
            args, kwargs = split_inputs(move_data_to_device(example, strategy.root_device))
            self.planned.build(strategy.target(), args, kwargs)
            assert self.pipeline is not None
            # Lightning's model summary runs the example in eval mode with hooks on every layer,
            # which tracing would run on traced values
            with torch.inference_mode(False), torch.no_grad():
                self.pipeline.prepare(*args, training=False, **kwargs)
        if trainer.state.fn == TrainerFn.FITTING:
            state_with_parameters(strategy.optimizers)  # Lightning put it all on the root device
        self._leftovers_placed = False
        self._forward_patch.install(strategy.target(), self._pipelined_forward)

    def _pipelined_forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        output = self.planned.forward(self.strategy.target(), args, kwargs, training_step=self._in_training_step)
        self.stages_placed()  # where the stages were placed by this call
        pipeline = self.pipeline
        if self._in_training_step and pipeline is not None and pipeline.reduction is None and self._replicated():
            # after the first training forward: the one point where every replica holds its stages (a
            # replica that did not plan captures them in that forward) and makes the same collectives
            pipeline.reduction = self._reduction(pipeline)
        return output

    def step(self, hook: str, args: tuple, kwargs: dict, plain: Callable[..., Any]) -> Any:
        """The step ``hook``: the user's, once per batch, the module's forward pipelined."""
        if hook != TRAINING:
            return plain(*args, **kwargs)
        step = self.pipeline.last_step if self.pipeline is not None else None
        module = self.strategy.lightning_module
        if self.log_stage_times and step is not None:
            for k, busy in enumerate(step.busy_s):  # the previous step's, backward included
                module.log(f"pipeline/stage{k}_busy_ms", 1e3 * busy, on_step=True, on_epoch=False)
        check = self.planned.prediction_check
        if check is not None and step is not None:
            stale = check.observe(step.timed)  # the previous step's
            if stale:
                rank_zero_warn(stale)
        calls = self._calls
        self._in_training_step = True
        try:
            output = plain(*args, **kwargs)
        finally:
            self._in_training_step = False
        if not self._checked_first_step:
            self._checked_first_step = True
            if self._calls == calls:
                raise RuntimeError(
                    f"training_step never called the pipelined module ({self.strategy.describe_target()}), so nothing "
                    "was pipelined. Call it in training_step (e.g. self(x)), or set "
                    "AntichainPipelineStrategy(module='name') to the submodule your step calls."
                )
        return output

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any, plain: Callable[..., Any], **kwargs: Any
                       ) -> Any:
        """Average the gradients of the replicas after the closure's backward, before the step;
        after it, refuse a stage that held more than its memory budget."""
        strategy = self.strategy
        if strategy.is_distributed and _distributed_is_initialized():
            run = closure

            def closure(*args: Any, **kw: Any) -> Any:
                result = run(*args, **kw)
                reduction = self.pipeline.reduction if self.pipeline is not None else None
                held = reduction.held if reduction is not None else set()
                params = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
                average_gradients(params, strategy.root_device)
                return result

        result = plain(optimizer, closure, model, **kwargs)
        self.planned.check_budgets()
        return result

    def stages_placed(self) -> None:
        """Once the stages are placed: the pipelined module's tensors that no stage uses (a loss
        module, metrics, an unused branch) go to the root device, where the step runs."""
        pipeline = self.pipeline
        if self._leftovers_placed or pipeline is None or not pipeline.stages:
            return
        self._leftovers_placed = True
        staged: set[int] = set()
        for stage in pipeline.stages:
            tensors = [*stage.parameters(), *stage.buffers(), *(b for m in stage.submodules() for b in m.buffers())]
            staged |= {id(t) for t in tensors} | {id(t.grad) for t in tensors if t.grad is not None}
        staged |= {id(p) for p in pipeline.tied.parameters()}  # each stays where its first stage reads it
        root = self.strategy.root_device
        self.strategy.lightning_module._apply(lambda t: t if t.is_meta or id(t) in staged else t.to(root))

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:  # type: ignore[override]
        """No reduction between the replicas while Lightning accumulates gradients."""
        reduction = self.pipeline.reduction if self.pipeline is not None else None
        with reduction.paused() if reduction is not None else contextlib.nullcontext():
            yield

    def _replicated(self) -> bool:
        return self.strategy.is_distributed and _distributed_is_initialized()

    def _reduction(self, pipeline: Pipeline) -> StageReduction:
        """Each stage's DDP over the replicas, on a process group of the stage's own (made once, in
        the same order on every rank). A parameter that several stages read (a tied weight) is left
        to the average after the backward."""
        stages = [stage.parameters() for stage in pipeline.stages]
        readers = Counter(id(p) for parameters in stages for p in parameters)
        tied = {id(p) for p in pipeline.tied.parameters()}
        while len(self._stage_groups) < len(stages):
            self._stage_groups.append(torch.distributed.new_group(timeout=self.strategy.timeout))
        return StageReduction([[p for p in parameters if readers[id(p)] == 1 and id(p) not in tied]
                               for parameters in stages], self._stage_groups[:len(stages)])

    def teardown(self) -> None:
        self._forward_patch.uninstall()
        if self.pipeline is not None:
            self.pipeline.reduction = None
            self.tasks_before += self.pipeline.tasks_run
            self.planned.close()  # modules go back to the CPU after; the plan is kept for the next run


class InProcessRanks(Ranks):
    """One process per pipeline replica, driving its pipeline's devices: each stage on one of
    them (or as ``placement`` says)."""

    def __init__(self, strategy: Host) -> None:
        self.strategy = strategy

    def devices_per_process(self, requested: int | None, node_devices: int) -> int:
        return requested or node_devices

    @property
    def shards_data(self) -> bool:
        return self.strategy.multi_process  # each replica is a process with its share, as under DDP

    def stage_slots(self) -> tuple[int, ...]:
        """Each stage's device by its index among the pipeline's (CPU devices are one torch device)."""
        return tuple(self.strategy.placement or range(self.strategy.devices_per_pipeline))

    def check_devices(self, stages: int | None, what: str) -> None:
        strategy = self.strategy
        placement, per_pipeline = strategy.placement, strategy.devices_per_pipeline
        if placement is not None and max(placement) >= per_pipeline:
            raise ValueError(f"placement={placement} names device {max(placement)}, but each pipeline has "
                             f"{per_pipeline} devices (0 to {per_pipeline - 1}); give more devices or name fewer")
        if stages is not None and stages != len(strategy.stage_devices):
            if placement is not None:
                raise ValueError(f"{what} has {stages} stages but placement={placement} has {len(placement)}; give "
                                 "one device index per stage")
            raise ValueError(
                f"{what} has {stages} stages but the Trainer gives {per_pipeline} devices per pipeline; set "
                f"devices={stages} (one device per stage), or placement= with a device for each of {stages} stages")
