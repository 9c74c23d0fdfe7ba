"""The strategy's runtime when one process drives every stage of its pipeline (the default).

The pipelined module's forward becomes the Pipeline's (planned on the first batch, or on
``example_input_array``): the user's step runs once per batch on the joined output, and
Lightning's backward enters the stages' backward. Replicas (one such process each) keep each
stage in step with torch's DDP, which reduces during the stage's last backward
(:mod:`~lightning_antichain.runtime.stage_reduction`); after the optimizer step, a stage that held
more than its memory budget is refused.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ..capture.signature import split_inputs
from ..runtime.optimizer_state import state_with_parameters
from ..runtime.pipeline import Pipeline
from ..runtime.plan import Plan
from ..runtime.stage_reduction import StageReduction, average_gradients
from .forward_patch import ForwardPatch
from .planned_pipeline import PlannedPipeline

TRAINING = "training_step"


class Host(Protocol):
    """What the strategy tells this runtime."""

    lightning_module: Any
    root_device: torch.device
    world_size: int
    is_distributed: bool
    optimizers: list[Any]
    module_path: str | None

    def target(self) -> nn.Module: ...

    def describe_target(self) -> str: ...


class InProcessRuntime:
    """One Pipeline per process, its stages in worker threads (see the module's docstring)."""

    def __init__(self, host: Host, planned: PlannedPipeline, log_stage_times: bool) -> None:
        self.host = host
        self.planned = planned
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

    def setup(self, trainer: Any) -> None:
        """Build on ``example_input_array`` where the module has one; make the forward the pipeline's."""
        host = self.host
        example = getattr(host.lightning_module, "example_input_array", None)
        if example is not None and host.module_path is None and self.pipeline is None:
            args, kwargs = split_inputs(move_data_to_device(example, host.root_device))
            self.planned.build(host.target(), args, kwargs)
            assert self.pipeline is not None
            # Lightning's model summary runs the example in eval mode with hooks on every layer,
            # which tracing would run on traced values
            with torch.inference_mode(False), torch.no_grad():
                self.pipeline.prepare(*args, training=False, **kwargs)
        if trainer.state.fn == TrainerFn.FITTING:
            state_with_parameters(host.optimizers)  # Lightning put it all on the root device
        self._leftovers_placed = False
        self._forward_patch.install(host.target(), self._pipelined_forward)

    def _pipelined_forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        output = self.planned.forward(self.host.target(), args, kwargs, training_step=self._in_training_step)
        self.stages_placed()  # where the stages were placed by this call
        pipeline = self.pipeline
        if self._in_training_step and pipeline is not None and pipeline.reduction is None and self._replicated():
            # after the first training forward: the one point where every replica holds its stages (a
            # replica that did not plan captures them in that forward) and makes the same collectives
            pipeline.reduction = self._reduction(pipeline)
        return output

    def step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """The step ``hook``: the user's, once per batch, the module's forward pipelined."""
        if hook != TRAINING:
            return getattr(Strategy, hook)(self.host, *args, **kwargs)
        step = self.pipeline.last_step if self.pipeline is not None else None
        module = self.host.lightning_module
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
            output = Strategy.training_step(self.host, *args, **kwargs)
        finally:
            self._in_training_step = False
        if not self._checked_first_step:
            self._checked_first_step = True
            if self._calls == calls:
                raise RuntimeError(
                    f"training_step never called the pipelined module ({self.host.describe_target()}), so nothing "
                    "was pipelined. Call it in training_step (e.g. self(x)), or set "
                    "AntichainPipelineStrategy(module='name') to the submodule your step calls."
                )
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return Strategy.backward(self.host, closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Average the gradients of the replicas after the closure's backward, before the step;
        after it, refuse a stage that held more than its memory budget."""
        host = self.host
        if host.is_distributed and _distributed_is_initialized():
            run = closure

            def closure(*args: Any, **kw: Any) -> Any:
                result = run(*args, **kw)
                reduction = self.pipeline.reduction if self.pipeline is not None else None
                held = reduction.held if reduction is not None else set()
                params = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
                average_gradients(params, host.root_device)
                return result

        result = Strategy.optimizer_step(host, optimizer, closure, model, **kwargs)
        self.planned.check_budgets()
        return result

    def gathered_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return state  # every tensor is this process's own

    def gathered_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def own_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def stepped(self, optimizer: Any) -> set[int] | None:
        return None  # every parameter

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
        root = self.host.root_device
        self.host.lightning_module._apply(lambda t: t if t.is_meta or id(t) in staged else t.to(root))

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """No reduction between the replicas while Lightning accumulates gradients."""
        reduction = self.pipeline.reduction if self.pipeline is not None else None
        with reduction.paused() if reduction is not None else contextlib.nullcontext():
            yield

    def _replicated(self) -> bool:
        return self.host.is_distributed and _distributed_is_initialized()

    def _reduction(self, pipeline: Pipeline) -> StageReduction:
        """Each stage's DDP over the replicas, on a process group of the stage's own (made once, in
        the same order on every rank). A parameter that several stages read (a tied weight) is left
        to the average after the backward."""
        stages = [stage.parameters() for stage in pipeline.stages]
        readers = Counter(id(p) for parameters in stages for p in parameters)
        tied = {id(p) for p in pipeline.tied.parameters()}
        while len(self._stage_groups) < len(stages):
            self._stage_groups.append(torch.distributed.new_group())
        return StageReduction([[p for p in parameters if readers[id(p)] == 1 and id(p) not in tied]
                               for parameters in stages], self._stage_groups[:len(stages)])

    def teardown(self) -> None:
        self._forward_patch.uninstall()
        if self.pipeline is not None:
            self.pipeline.reduction = None
            self.tasks_before += self.pipeline.tasks_run
            self.planned.close()  # modules go back to the CPU after; the plan is kept for the next run
