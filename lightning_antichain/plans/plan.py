"""The Plan: which operations run on which device, and what that is predicted to cost.

A plan is data. It is printed as a table for people, saved as JSON for the runtime and for reuse,
and loaded back unchanged. Times are per micro-batch unless a name says otherwise.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..device import shares_host
from .schedule import GRADIENT_OUT, INPUT_SHARE, Phase, Schedule, Task, Timed, make_schedule, timeline

PLAN_FORMAT = "lightning-antichain/plan/1"
RECOMPUTE_MODES = ("never", "except_last", "always")
"""Activation recomputation: none, every micro-batch but the last, or every one."""


def recomputed_micro_batches(recompute: str, chunks: int) -> int:
    """How many micro-batches, from the first, the runtime recomputes in backward under ``recompute``."""
    return {"never": 0, "except_last": chunks - 1, "always": chunks}[recompute]


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


@dataclass
class Plan:
    """Stages in pipeline order with the predicted cost of a training step.

    ``bottleneck_s`` is the slowest stage's time per micro-batch; ``lower_bound_s`` is
    ``max(total compute / total device speed, slowest single operation)``, which no split can beat;
    ``predicted_step_s`` is one step of ``chunks`` micro-batches under ``schedule`` (see
    :mod:`lightning_antichain.plans.schedule`), fill and drain included, with what the runtime adds: each
    task's ``task_overhead_s``, each step's ``step_overhead_s`` and ``optimizer_step_s``, and, for
    CPU stages that run at once, the slowdown that the profile's ``parallel_capacity`` (two at once
    against one alone) implies on a machine of ``cpu_cores`` cores. ``compression`` says what the
    planner simplified to stay fast.
    ``frontend`` names the capture frontend whose graph was planned, and ``refused`` why the
    frontends before it could not capture the model. ``candidates`` lists, for a plan made with
    ``chunks="auto"`` for batches of ``batch_size``, every micro-batch count weighed, with its
    predicted step and peak stage memory. ``calibration`` holds what a few steps of this plan
    measured in the runtime, when its stage times and parallel capacity were taken from them
    (:mod:`lightning_antichain.planner.calibration`), with the profiled values they replaced.
    ``layout`` is the layout of replicas x stages that ``stages="auto"`` chose (``dp``, ``pp``,
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
    candidates: list[dict[str, Any]] = field(default_factory=list)
    batch_size: int | None = None
    calibration: dict[str, Any] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    repeated_blocks: dict[str, list[str]] = field(default_factory=dict)
    layout: dict[str, Any] | None = None
    layouts: list[dict[str, Any]] = field(default_factory=list)

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
        """A fixed-width table of the stages, with the plan's totals underneath."""
        named = any(s.modules for s in self.stages)
        span = "first .. last module" if named else "first .. last op"
        header = ("stage", "device", "ops", span, "compute ms", "transfer ms", "memory MB")
        rows = [
            (
                str(s.index),
                s.device,
                str(len(s.nodes)),
                _span(s.modules if named else s.nodes),
                f"{1e3 * s.compute_s:.2f}",
                f"{1e3 * s.transfer_s:.2f}",
                f"{s.memory_bytes / 1e6:.1f}",
            )
            for s in self.stages
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(row: tuple[str, ...]) -> str:
            cells = (c.ljust(w) if i == 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            return "  ".join(cells)

        bandwidth = "unlimited" if self.bandwidth_gbps is None else f"{self.bandwidth_gbps:g} GB/s"
        lines = [
            f"plan for {self.model or 'model'}: {self.num_stages} stages, {self.chunks} micro-batches"
            f" of {self.micro_batch_size}, method {self.method}, bandwidth {bandwidth}",
            line(header),
            line(tuple("-" * w for w in widths)),
            *map(line, rows),
            f"bottleneck {1e3 * self.bottleneck_s:.2f} ms/micro-batch, "
            f"lower bound {1e3 * self.lower_bound_s:.2f} ms (x{self.bound_ratio:.3f}); "
            f"predicted step {1e3 * self.predicted_step_s:.1f} ms",
            f"{self.num_nodes} ops, {self.num_states} states, solved in {self.solve_s:.3f} s"
            + ("" if self.profile_s is None else f", profiled in {self.profile_s:.1f} s")
            + ("" if self.frontend is None else f"; captured by {self.frontend}"),
        ]
        costs = [f"runtime {1e3 * self.task_overhead_s:.2f} ms per task, {1e3 * self.step_overhead_s:.2f} ms per step"]
        if self.optimizer_step_s:
            costs.append(f"optimizer step {1e3 * self.optimizer_step_s:.1f} ms")
        if self.parallel_capacity is not None:
            costs.append(f"two CPU stages at once do {self.parallel_capacity:.2f}x the work of one")
        lines.append("included: " + ", ".join(costs))
        if self.calibration is not None:
            profiled = sum(self.calibration["profiled_compute_s"])
            was = self.calibration["profiled_parallel_capacity"]
            lines.append(
                f"calibrated on {self.calibration['steps']} steps of this plan: stage times "
                f"x{self.total_compute_s / profiled if profiled > 0 else 1.0:.2f} of profiled"
                + ("" if was is None or self.parallel_capacity == was else f", parallel capacity was {was:.2f}")
                + (f" (cached: {self.calibration['read_from']})" if self.calibration.get("read_from") else "")
            )
        if self.calibration is not None and self.calibration.get("profiled_bound_ratio") is not None:
            lines.append(f"measured balance: bottleneck x{self.bound_ratio:.3f} of the measured stages' bound; "
                         f"x{self.calibration['profiled_bound_ratio']:.3f} predicted when it was cut")
        if len(self.rounds) > 1:
            lines.append(f"split measured in {len(self.rounds)} rounds (each cut again on the operation times "
                         "measured so far), the best kept:")
            for i, row in enumerate(self.rounds):
                lines.append(
                    f"  round {i}: {row['balance']} ops, predicted x"
                    f"{_ratio(row['profiled_bottleneck_s'], row['profiled_lower_bound_s']):.3f}, measured bottleneck "
                    f"{1e3 * row['measured_bottleneck_s']:.2f} ms (x"
                    f"{_ratio(row['measured_bottleneck_s'], row['measured_lower_bound_s']):.3f})"
                    + ("  <- chosen" if row.get("chosen") else ""))
        for reference, blocks in self.repeated_blocks.items():
            lines.append(f"profiled once: {_span(blocks)} ({len(blocks)} blocks) repeat {reference} operation for "
                         f"operation, and took its times and memory")
        if self.candidates:
            lines.append(f"chunks=auto for batches of {self.batch_size}: chose {self.chunks}")
            for row in self.candidates:
                if row.get("fails"):
                    step = f"cannot run: {row['fails']}"
                elif not row["fits"]:
                    step = "does not fit in memory"
                else:
                    step = (f"predicted step {1e3 * row['predicted_step_s']:.1f} ms, "
                            f"peak {row['peak_memory_bytes'] / 1e6:.1f} MB")
                lines.append(f"  chunks {row['chunks']:>3} (micro-batches of {row['micro_batch_size']}): {step}")
        if self.layout:
            lines.append(f"stages=auto for batches of {self.batch_size}: chose {_layout_name(self.layout)}, "
                         f"{self.chunks} micro-batches")
            lines += [f"  {_layout_name(row)}{_chunks_of(row, count)}: " + _weighed(row)
                      for row, count in _best_per_layout(self.layouts)]
        lines += [f"capture: {reason}" for reason in self.refused]
        lines += [f"note: {c}" for c in self.compression]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def timeline(self, schedule: Schedule | None = None, replicas: int = 1) -> list[Timed]:
        """The predicted start and end of every task of one step (:func:`schedule.timeline`), each
        stage's transfer split evenly between its forward and its backward, and the backward of a
        micro-batch that ``recompute`` recomputes charged its forward again. ``schedule``: the
        tasks as run (torch's table for a rank's virtual stages,
        :meth:`~lightning_antichain.plans.process_schedules.ProcessSchedule.table`); default,
        the plan's own schedule over one worker per stage. ``replicas``: pipelines running the
        same step at once, whose CPU stages share the machine with these."""
        recomputed = recomputed_micro_batches(self.recompute, self.chunks)

        def duration(task: Task) -> float:
            stage = self.stages[task.stage]
            again = task.phase in GRADIENT_OUT and task.micro_batch < recomputed
            return self.task_seconds(stage, task.phase) + (stage.forward_s if again else 0.0)

        schedule = schedule or make_schedule(self.schedule, self.num_stages, self.chunks)
        if schedule.stages != self.num_stages or schedule.chunks != self.chunks:
            raise ValueError(f"a schedule of {schedule.stages} stages and {schedule.chunks} micro-batches does not "
                             f"run this plan of {self.num_stages} stages and {self.chunks}")
        return timeline(
            schedule,
            duration,
            capacity=self.capacity(replicas),
            shared=[shares_host(self.stages[tasks[0].stage].device) and not self.measured_together if tasks else False
                    for tasks in schedule.order],
            copies=replicas,
        )

    def task_seconds(self, stage: Stage, phase: Phase) -> float:
        """What one task of ``phase`` on ``stage`` takes alone: its compute, half the stage's transfer
        (the input's gradient carries the backward's half), and the runtime's ``task_overhead_s``."""
        half = stage.transfer_s / 2
        if phase == "forward":
            return stage.forward_s + half + self.task_overhead_s
        if phase == "backward":
            return stage.backward_s + half + self.task_overhead_s
        input_s, weight_s = stage.backward_halves()
        return (input_s + half if phase == "backward_input" else weight_s) + self.task_overhead_s

    @property
    def measured_together(self) -> bool:
        """Whether the stage times were measured while the stages ran at once (each a process of its
        own: :mod:`~lightning_antichain.planner.process_calibration`), so they hold the slowdown of
        sharing the CPU already."""
        return bool(self.calibration) and self.calibration.get("runtime") == "processes"

    def capacity(self, replicas: int = 1) -> list[float]:
        """Work done by 1, 2, ... CPU stages (of ``replicas`` pipelines) running at once, in units
        of one alone: each stage beyond the first adds what the second added in the profile, while
        there are cores for it."""
        count = self.num_stages * replicas
        if self.parallel_capacity is None:
            return [float(n) for n in range(1, count + 1)]
        cores = self.cpu_cores or count
        extra = self.parallel_capacity - 1.0
        return [1.0 + extra * (min(n, cores) - 1) for n in range(1, count + 1)]

    def predict_step(self, schedule: Schedule | None = None, replicas: int = 1) -> float:
        """Seconds of one training step (under ``schedule``, with ``replicas`` pipelines at once,
        see :meth:`timeline`): the end of the timeline plus the per-step costs."""
        return max(t.end for t in self.timeline(schedule, replicas)) + self.step_overhead_s + self.optimizer_step_s


def _layout_name(row: dict[str, Any]) -> str:
    name = f"dp={row['dp']} x pp={row['pp']} {row['schedule']}"
    return name + (f" ({row['virtual_stages']} stages each)" if row.get("virtual_stages", 1) > 1 else "")


def _best_per_layout(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """Each layout's fastest micro-batch count (or its first row, where none runs), with the count
    of its rows."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["dp"], row["pp"], row["schedule"]), []).append(row)

    def rank(row: dict[str, Any]) -> tuple[bool, bool, float]:  # fits and runs first, then by step
        ran = row.get("predicted_step_s") is not None
        return not ran, ran and row.get("lost", "").startswith("needs"), row.get("predicted_step_s") or 0.0

    return [(min(group, key=rank), len(group)) for group in groups.values()]


def _chunks_of(row: dict[str, Any], count: int) -> str:
    if row.get("chunks") is None:
        return ""
    return f", chunks {row['chunks']}" + (f" (best of {count})" if count > 1 else "")


def _weighed(row: dict[str, Any]) -> str:
    step = "" if row.get("predicted_step_s") is None else (
        f"predicted step {1e3 * row['predicted_step_s']:.1f} ms, peak {row['peak_memory_bytes'] / 1e6:.1f} MB per "
        "rank")
    return ", ".join(part for part in (step, row.get("lost", "chosen")) if part)


def _span(nodes: list[str]) -> str:
    if not nodes:
        return "-"
    return nodes[0] if len(nodes) == 1 else f"{nodes[0]} .. {nodes[-1]}"


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return None
    return float(value)


def _ratio(bottleneck: float, bound: float) -> float:
    """A bottleneck over its lower bound, as :attr:`Plan.bound_ratio` reads one (1.0 where the
    bound is 0: stages measured faster than the runtime's own cost per task leave no time)."""
    return bottleneck / bound if bound > 0 else 1.0
