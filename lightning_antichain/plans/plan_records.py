"""The records a :class:`~.plan.Plan` keeps of how it was chosen, each a typed dict.

They stay dicts, as the plan's JSON holds them, so that a saved plan loads back unchanged and a
person reads it as written; their keys and types are named here, once. Keys a record may lack
are those of its second part (``total=False``).
"""

from __future__ import annotations

from typing import TypedDict


class ChunkCount(TypedDict, total=False):
    """One micro-batch count ``chunks="auto"`` weighed (:attr:`Plan.candidates`): its
    micro-batches, the step predicted and the largest stage's memory where it fits, else why not."""

    chunks: int
    micro_batch_size: int
    predicted_step_s: float | None
    peak_memory_bytes: int | None
    fits: bool
    fails: str


class RebalanceRound(TypedDict):
    """One round of cutting again on measured stage times (:attr:`Plan.rounds`)."""

    balance: list[int]
    profiled_bottleneck_s: float
    profiled_lower_bound_s: float
    measured_bottleneck_s: float
    measured_lower_bound_s: float


class _LayoutKeys(TypedDict):
    dp: int
    pp: int
    schedule: str
    virtual_stages: int


class ChosenLayout(_LayoutKeys, total=False):
    """The layout of replicas x stages a plan runs in (:attr:`Plan.layout`): ``dp`` pipelines of
    ``pp`` processes under ``schedule``, their stages kept in step by ``replication``, FSDP2
    gathering each block's parameters as ``regather`` says."""

    replication: str
    regather: str


class WeighedLayout(ChosenLayout, total=False):
    """One layout and micro-batch count the layout search weighed (:attr:`Plan.layouts`): what it
    predicted, what it measured where the ranks timed it, and why it lost (``lost``)."""

    chunks: int | None
    micro_batch_size: int
    predicted_step_s: float
    reduction_s: float
    optimizer_s: float
    rank_optimizer_s: list[float]
    rank_end_s: list[float]
    rank_busy_s: list[float]
    peak_memory_bytes: int
    limit_bytes: int
    terms_s: dict[str, float]
    moved_bytes: dict[str, float]
    decided_by: str
    communication_bound: bool
    predicted_step_as_cores_vary_s: list[float]
    regret_s: float
    profile_scaled_by: float
    measured_step_s: float
    outrun: bool
    lost: str


class CalibrationRecord(TypedDict, total=False):
    """What the first steps of a plan measured, where its stage times were taken from them
    (:attr:`Plan.calibration`), with the profiled values they replaced. In process
    (:mod:`~lightning_antichain.planner.calibration`): each stage's times alone, the parallel
    capacity and the pipelined step; as processes (``runtime="processes"``,
    :mod:`~lightning_antichain.planner.process_calibration`): the step measured under ``schedule``
    and the part of it the timeline of the actions explains."""

    forward_s: list[float]
    backward_s: list[float]
    parallel_capacity: float | None
    pipelined_step_s: float
    pipelined_span_s: float
    steps: int
    operations: dict[str, list[float]]
    profiled_compute_s: list[float]
    profiled_bound_ratio: float
    profiled_parallel_capacity: float | None
    read_from: str | None
    runtime: str
    schedule: str
    measured_step_s: float
    profiled_step_s: float
    profiled_forward_s: list[float]
    profiled_backward_s: list[float]
    explained_step_s: float
