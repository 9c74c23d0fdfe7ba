"""The Plan: which operations run on which device, and what that is predicted to cost.

A plan is data. It is printed as a table for people, saved as JSON for the runtime and for reuse,
and loaded back unchanged. Times are per micro-batch unless a name says otherwise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .plan_records import CalibrationRecord, ChosenLayout, ChunkCount, RebalanceRound, WeighedLayout
from .plan_table import plan_table
from .schedule import INPUT_SHARE, Schedule, Task, Timed
from .step_prediction import StepPrediction

PLAN_FORMAT = "lightning-antichain/plan/1"
RECOMPUTE_MODES = ("never", "except_last", "always")
"""Activation recomputation: none, every micro-batch but the last, or every one."""


def check_chunks(chunks: object, auto: bool = False) -> int | str:
    """``chunks`` if it is a micro-batch count (or, where ``auto``, ``"auto"``); else a clear error."""
    if auto and chunks == "auto":
        return "auto"
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        also = ', or "auto" to let the planner choose' if auto else ""
        raise ValueError(
            f"chunks is the number of micro-batches per batch, a whole number of at least 1{also}; got {chunks!r}"
        )
    return chunks


@dataclass
class Stage:
    """One pipeline stage: a convex set of operations on one device.

    ``compute_s`` is forward plus backward of one micro-batch on this device; ``transfer_s`` ships
    the stage's input cut in and its output cut out, forward and the gradients back.
    ``memory_bytes`` counts parameters, their gradients and optimizer state (none for the
    ``frozen_bytes`` of parameters that need no gradient), buffers, and what the
    plan's ``recompute`` mode keeps for backward at its peak: ``activation_bytes`` (what one
    micro-batch keeps: saved tensors, inputs and outputs) for each of ``chunks`` micro-batches, or,
    with recomputation, one micro-batch's ``activation_bytes`` and ``kept_input_bytes`` (a recomputed
    micro-batch's inputs) for each of the others. ``modules`` names the modules of the stage's
    first and last operations. ``input_bytes`` and ``output_bytes`` are the cuts
    as shipped. ``joined_output_bytes``, on the first stage of a plan run in one process, is the
    whole batch's output joined on that stage's device (the strategy's root device) and its
    gradient, and ``loss_workspace_bytes`` what the loss's own computation adds to that device's
    peak; ``memory_bytes`` counts both.
    """

    index: int
    device: str
    nodes: list[str]
    forward_s: float
    backward_s: float
    transfer_s: float
    memory_bytes: int
    param_bytes: int
    buffer_bytes: int
    activation_bytes: int
    input_bytes: int
    output_bytes: int
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    speed: float = 1.0
    memory_limit_bytes: int | None = None
    kept_input_bytes: int = 0
    frozen_bytes: int = 0
    modules: list[str] = field(default_factory=list)
    #: where a zero-bubble schedule splits the backward, the seconds of its two halves as measured
    #: (the input's gradient, the weights'); ``None``: ``backward_s`` split by share
    backward_input_s: float | None = None
    backward_weight_s: float | None = None
    joined_output_bytes: int = 0
    loss_workspace_bytes: int = 0
    #: of ``param_bytes``, the largest share one block's operations own (a decoder layer), and the
    #: share no block owns: FSDP2 sharding each block on its own gathers one block at a time, and
    #: the rest for the whole step (:mod:`~lightning_antichain.stages.block_units`)
    largest_block_bytes: int = 0
    unblocked_param_bytes: int = 0
    #: how many blocks own parameters: FSDP2 gathers and reduce-scatters each with its own collective
    param_blocks: int = 0
    #: how many parameter tensors the optimizer steps: under FSDP2 each is a DTensor, whose every
    #: operation goes through DTensor's dispatch (:attr:`Plan.optimizer_tensor_s`)
    param_tensors: int = 0

    def backward_halves(self) -> tuple[float, float]:
        """The seconds of the two halves of a split backward: as measured, else ``backward_s``
        split by :data:`~.schedule.INPUT_SHARE`. The first stage's input needs no gradient, so
        torch runs its whole backward as the weights' half."""
        if self.backward_input_s is not None and self.backward_weight_s is not None:
            return self.backward_input_s, self.backward_weight_s
        if self.index == 0:
            return 0.0, self.backward_s
        return self.backward_s * INPUT_SHARE, self.backward_s * (1.0 - INPUT_SHARE)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def time_s(self) -> float:
        """What the stage adds to every pipeline clock tick: compute plus transfer."""
        return self.compute_s + self.transfer_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compute_s": self.compute_s, "time_s": self.time_s}


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order with the predicted cost of a training step; frozen: a plan made
    for another layout or from measured times is a new one (``dataclasses.replace``).

    ``bottleneck_s`` is the slowest stage's time per micro-batch; ``lower_bound_s`` is
    ``max(total compute / total device speed, slowest single operation)``, which no split can beat;
    ``predicted_step_s`` is one step of ``chunks`` micro-batches under ``schedule`` (see
    :mod:`lightning_antichain.plans.schedule`), fill and drain included, with what the runtime adds: each
    task's ``task_overhead_s``, each backward after a stage's first its ``accumulate_s_per_byte``
    over the stage's trainable bytes, each step's ``step_overhead_s`` and ``optimizer_step_s``, and, for
    CPU stages that run at once, the slowdown that the profile's ``parallel_capacity`` (two at once
    against one alone) implies on a machine of ``cpu_cores`` cores. ``compression`` says what the
    planner simplified to stay fast.
    ``frontend`` names the capture frontend whose graph was planned, and ``refused`` why the
    frontends before it could not capture the model. ``candidates`` lists, for a plan made with
    ``chunks="auto"`` for batches of ``batch_size``, every micro-batch count weighed, with its
    predicted step and peak stage memory. ``calibration`` holds what a few steps of this plan
    measured in the runtime, when its stage times and parallel capacity were taken from them
    (:mod:`lightning_antichain.planner.calibration`), with the profiled values they replaced.
    ``layout`` is the layout of replicas x stages that ``pipeline_parallel_size="auto"`` chose (``dp``, ``pp``,
    ``schedule``, ``virtual_stages``, ``replication``), and ``layouts`` every candidate it weighed,
    each with its predicted step and peak memory per rank, or why it could not run, and why it lost
    (:mod:`lightning_antichain.planner.layout_search`).
    """

    stages: list[Stage]
    method: str
    chunks: int
    bottleneck_s: float
    lower_bound_s: float
    predicted_step_s: float
    total_compute_s: float
    micro_batch_size: int | None = None
    bandwidth_gbps: float | None = None
    optimizer_multiplier: float = 2.0
    recompute: str = "never"
    num_nodes: int = 0
    num_states: int = 0
    solve_s: float = 0.0
    profile_s: float | None = None
    compression: list[str] = field(default_factory=list)
    model: str | None = None
    granularity: str | None = None
    profiled_on: str | None = None
    frontend: str | None = None
    refused: list[str] = field(default_factory=list)
    schedule: str = "gpipe"
    task_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    optimizer_step_s: float = 0.0
    parallel_capacity: float | None = None
    cpu_cores: int | None = None
    #: how much slower the optimizer steps with every rank stepping at once, where the ranks (CPU
    #: processes on one machine) measured it; ``None``: as the model's work slows
    optimizer_slowdown: float | None = None
    #: what a parameter tensor adds to the optimizer's step as a DTensor (FSDP2), seconds, where the
    #: ranks measured it; 0: not measured
    optimizer_tensor_s: float = 0.0
    candidates: list[ChunkCount] = field(default_factory=list)
    batch_size: int | None = None
    calibration: CalibrationRecord | None = None
    rounds: list[RebalanceRound] = field(default_factory=list)
    repeated_blocks: dict[str, list[str]] = field(default_factory=dict)
    layout: ChosenLayout | None = None
    layouts: list[WeighedLayout] = field(default_factory=list)
    #: how often FSDP2 gathers each block's parameters where replicas shard the stages:
    #: ``"micro_batch"`` or ``"step"`` (:data:`~lightning_antichain.processes.replication.Regather`),
    #: as the layout search or the planner for a given layout chose it; ``None``: nothing sharded
    regather: str | None = None
    #: seconds a backward adds per byte of its stage's trainable parameters where it adds its
    #: gradients into those already there (every backward of a step on a stage but the first), a
    #: pass over them that the profile's backwards, into empty gradients, leave out
    #: (:func:`~lightning_antichain.planner.overhead.measure_accumulation_rate`); 0: not charged
    accumulate_s_per_byte: float = 0.0
    #: how many ranks each stage's gradients are spread over as a backward adds into them: the
    #: replicas where FSDP2 reduce-scatters every backward's (``regather="micro_batch"``), else 1
    gradient_shards: int = 1
    #: the batches whose gradients Lightning accumulates before the optimizers step
    #: (``Trainer(accumulate_grad_batches=)``): a stage's first backward of a batch adds into the
    #: gradients too, in every batch of the window but its first
    accumulate_grad_batches: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bound_ratio(self) -> float:
        """``bottleneck_s / lower_bound_s``: 1.0 is a split no other can beat."""
        return self.bottleneck_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    @property
    def balance(self) -> list[int]:
        """Operations per stage, as ``balance=`` takes them (torchgpipe's ``balance``)."""
        return [len(s.nodes) for s in self.stages]

    def stage_of(self) -> dict[str, int]:
        """Map from node name to stage index."""
        return {node: stage.index for stage in self.stages for node in stage.nodes}

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "stages"}
        data["stages"] = [s.to_dict() for s in self.stages]
        data["balance"] = self.balance
        data["bound_ratio"] = self.bound_ratio
        return {"format": PLAN_FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a plan of format {PLAN_FORMAT!r}: format={data.get('format')!r}")
        if "checkpoint" in data and "recompute" not in data:  # saved before the field was renamed
            data = {**data, "recompute": data["checkpoint"]}
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        stage_fields = Stage.__dataclass_fields__
        fields["stages"] = [Stage(**{k: v for k, v in s.items() if k in stage_fields}) for s in data["stages"]]
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_json_number)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan saved at ``path`` by :meth:`save` (or ``lightning-antichain plan --output``)."""
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path} is not a plan saved by Plan.save or `lightning-antichain plan --output` "
                f"({type(exc).__name__}: {exc}). Save the plan again, or leave plan= out to plan anew."
            ) from exc

    def table(self) -> str:
        """A fixed-width table of the stages, with the plan's totals underneath (:mod:`.plan_table`)."""
        return plan_table(self)

    def __str__(self) -> str:
        return self.table()

    @property
    def measured_together(self) -> bool:
        """Whether the stage times were measured while the stages ran at once (each a process of its
        own: :mod:`~lightning_antichain.planner.process_calibration`), so they hold the slowdown of
        sharing the CPU already."""
        return bool(self.calibration) and self.calibration.get("runtime") == "processes"

    @property
    def prediction(self) -> StepPrediction:
        """What this plan predicts of a training step, task by task (:mod:`.step_prediction`)."""
        return StepPrediction(self)

    def timeline(self, schedule: Schedule | None = None, replicas: int = 1,
                 others: Sequence[tuple[float, float]] = (), held: Mapping[Task, float] | None = None
                 ) -> list[Timed]:
        """The predicted start and end of every task of one step (:meth:`StepPrediction.timeline`)."""
        return self.prediction.timeline(schedule, replicas, others, held)

    def predict_step(self, schedule: Schedule | None = None, replicas: int = 1) -> float:
        """Seconds of one training step (:meth:`StepPrediction.step_s`)."""
        return self.prediction.step_s(schedule, replicas)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return None
    return float(value)
