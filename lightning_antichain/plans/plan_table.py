"""The plan as a table for people: its stages, what its prediction includes, and how it was chosen.

A plan prints its stages (device, operations, first and last module, compute, transfer, memory)
and under them its totals and every choice behind it: calibration, the rounds of cutting again on
measured times, repeated blocks profiled once, the micro-batch counts ``chunks="auto"`` weighed
and the layouts ``pipeline_parallel_size="auto"`` weighed, each with why it lost.
"""

from __future__ import annotations

from typing import Any

from ..capture import tried_first


def plan_table(plan: Any) -> str:
    """A fixed-width table of ``plan``'s stages (a :class:`~.plan.Plan`), with its totals and choices underneath."""
    return "\n".join([*_stage_lines(plan), *_cost_lines(plan), *_choice_lines(plan)])


def _stage_lines(plan: Any) -> list[str]:
    """The title, the stages, the bottleneck and what planning took."""
    named = any(s.modules for s in plan.stages)
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
        for s in plan.stages
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = (c.ljust(w) if i == 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells)

    bandwidth = "unlimited" if plan.bandwidth_gbps is None else f"{plan.bandwidth_gbps:g} GB/s"
    lines = [
        f"plan for {plan.model or 'model'}: {plan.num_stages} stages, {plan.chunks} micro-batches"
        f" of {plan.micro_batch_size}, method {plan.method}, bandwidth {bandwidth}",
        line(header),
        line(tuple("-" * w for w in widths)),
        *map(line, rows),
        f"bottleneck {1e3 * plan.bottleneck_s:.2f} ms/micro-batch, "
        f"lower bound {1e3 * plan.lower_bound_s:.2f} ms (x{plan.bound_ratio:.3f}); "
        f"predicted step {1e3 * plan.predicted_step_s:.1f} ms",
        f"{plan.num_nodes} ops, {plan.num_states} states, solved in {plan.solve_s:.3f} s"
        + ("" if plan.profile_s is None else f", {_costed(plan)} in {plan.profile_s:.1f} s")
        + ("" if plan.frontend is None else f"; captured by {plan.frontend}{tried_first(plan.refused)}"),
    ]
    return lines


def _costed(plan: Any) -> str:
    """How the operations' costs were found: profiled here, or on a target GPU's roofline."""
    source = plan.profiled_on or ""
    return source.split(" (")[0].replace("roofline of", "costed on the roofline of") if source.startswith(
        "roofline of") else "profiled"


def _cost_lines(plan: Any) -> list[str]:
    """What the predicted step includes besides the stages, and what calibration changed."""
    lines: list[str] = []
    costs = [f"runtime {1e3 * plan.task_overhead_s:.2f} ms per task, {1e3 * plan.step_overhead_s:.2f} ms per step"]
    adding = max((plan.prediction.accumulation_s(s) for s in plan.stages), default=0.0)
    if adding:
        costs.append(f"adding into gradients up to {1e3 * adding:.2f} ms a backward after a stage's first")
    if plan.optimizer_step_s:
        costs.append(f"optimizer step {1e3 * plan.optimizer_step_s:.1f} ms")
    if plan.parallel_capacity is not None:
        costs.append(f"two CPU stages at once do {plan.parallel_capacity:.2f}x the work of one")
    lines.append("included: " + ", ".join(costs))
    if plan.calibration is not None:
        profiled = sum(plan.calibration["profiled_compute_s"])
        was = plan.calibration["profiled_parallel_capacity"]
        lines.append(
            f"calibrated on {plan.calibration['steps']} steps of this plan: stage times "
            f"x{plan.total_compute_s / profiled if profiled > 0 else 1.0:.2f} of profiled"
            + ("" if was is None or plan.parallel_capacity == was else f", parallel capacity was {was:.2f}")
            + (f" (cached: {plan.calibration['read_from']})" if plan.calibration.get("read_from") else "")
        )
    if plan.calibration is not None and plan.calibration.get("profiled_bound_ratio") is not None:
        lines.append(f"measured balance: bottleneck x{plan.bound_ratio:.3f} of the measured stages' bound; "
                     f"x{plan.calibration['profiled_bound_ratio']:.3f} predicted when it was cut")
    return lines


def _choice_lines(plan: Any) -> list[str]:
    """How the split, the micro-batch count and the layout were chosen, and what capture said."""
    lines: list[str] = []
    if len(plan.rounds) > 1:
        lines.append(f"split measured in {len(plan.rounds)} rounds (each cut again on the operation times "
                     "measured so far), the best kept:")
        for i, row in enumerate(plan.rounds):
            lines.append(
                f"  round {i}: {row['balance']} ops, predicted x"
                f"{_ratio(row['profiled_bottleneck_s'], row['profiled_lower_bound_s']):.3f}, measured bottleneck "
                f"{1e3 * row['measured_bottleneck_s']:.2f} ms (x"
                f"{_ratio(row['measured_bottleneck_s'], row['measured_lower_bound_s']):.3f})"
                + ("  <- chosen" if row.get("chosen") else ""))
    for reference, blocks in plan.repeated_blocks.items():
        lines.append(f"profiled once: {_span(blocks)} ({len(blocks)} blocks) repeat {reference} operation for "
                     f"operation, and took its times and memory")
    if plan.candidates:
        lines.append(f"chunks=auto for batches of {plan.batch_size}: chose {plan.chunks}")
        for row in plan.candidates:
            if row.get("fails"):
                step = f"cannot run: {row['fails']}"
            elif not row["fits"]:
                step = "does not fit in memory"
            else:
                step = (f"predicted step {1e3 * row['predicted_step_s']:.1f} ms, "
                        f"peak {row['peak_memory_bytes'] / 1e6:.1f} MB")
            lines.append(f"  chunks {row['chunks']:>3} (micro-batches of {row['micro_batch_size']}): {step}")
    if plan.layout:
        lines.append(f"pipeline_parallel_size=auto for batches of {plan.batch_size}: chose "
                     f"{_layout_name(plan.layout)}, {plan.chunks} micro-batches")
        lines += [f"  {_layout_name(row)}{_chunks_of(row, count)}: " + _weighed(row)
                  for row, count in _best_per_layout(plan.layouts)]
        lines += _near_ties(plan.layouts)
    if plan.frontend is None:  # no frontend captured the operations: why each could not
        lines += [f"capture: {reason}" for reason in plan.refused]
    lines += [f"note: {c}" for c in plan.compression]
    return lines


#: how close two layouts' predicted steps are where the prediction cannot be trusted to order them:
#: the band a layout's prediction is held to (0.85-1.15 of its measured step, docs/planner.md)
NEAR_TIE = 0.15


def _near_ties(rows: list[dict[str, Any]]) -> list[str]:
    """A note where other layouts of replicas x stages are predicted within :data:`NEAR_TIE` of
    the chosen and none was timed: the choice between them is the cost model's error, which
    ``layout_trials`` settles by timing them."""
    chosen = next((row for row in rows if "lost" not in row and row.get("predicted_step_s")), None)
    if chosen is None or chosen.get("regather") or any("measured_step_s" in row for row in rows):
        return []  # timed already, or sharded in place by FSDP2, which only the layout kept may be
    best: dict[tuple, float] = {}
    for row in rows:
        step, shape = row.get("predicted_step_s"), (row["dp"], row["pp"])
        if step is None or not row.get("outrun") or row.get("regather") or shape == (chosen["dp"], chosen["pp"]):
            continue  # does not run or fit, is not timed (sharded), or is the chosen layout otherwise run
        if step <= (1.0 + NEAR_TIE) * chosen["predicted_step_s"]:
            best[shape] = min(step, best.get(shape, step))
    if not best:
        return []
    close = ", ".join(f"dp={dp} x pp={pp} ({step / chosen['predicted_step_s'] - 1:+.0%})"
                      for (dp, pp), step in sorted(best.items(), key=lambda item: item[1]))
    return [f"note: {close} predicted within {NEAR_TIE:.0%} of the choice, inside the layout model's error: "
            f"layout_trials={len(best) + 1} times {'them' if len(best) > 1 else 'both'} on the ranks before "
            "training and keeps the quickest"]


def _layout_name(row: dict[str, Any]) -> str:
    name = f"dp={row['dp']} x pp={row['pp']} {row['schedule']}"
    name += f" ({row['virtual_stages']} stages each)" if row.get("virtual_stages", 1) > 1 else ""
    regather = row.get("regather")
    return name + ("" if regather is None else f", FSDP2 gathering {REGATHER_WORDS.get(regather, regather)}")


REGATHER_WORDS = {"micro_batch": "per micro-batch", "step": "once per step"}


def _best_per_layout(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """Each layout's fastest micro-batch count (or its first row, where none runs), with the count
    of its rows."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["dp"], row["pp"], row["schedule"], row.get("regather")), []).append(row)

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
    return ", ".join(part for part in (step, _terms(row), row.get("lost", "chosen")) if part)


def _terms(row: dict[str, Any]) -> str:
    """The term that decides a layout's step, and the bytes a rank sends a step (:mod:`step_terms`)."""
    terms = row.get("terms_s")
    if row.get("predicted_step_s") is None or not terms:
        return ""
    decided = row["decided_by"]
    found = f"{decided} {1e3 * terms[decided]:.1f} ms decides it, {row['moved_bytes'] / 1e9:.3g} GB sent a rank"
    return found + (" (communication-bound)" if row.get("communication_bound") else "")

def _span(nodes: list[str]) -> str:
    if not nodes:
        return "-"
    return nodes[0] if len(nodes) == 1 else f"{nodes[0]} .. {nodes[-1]}"

def _ratio(bottleneck: float, bound: float) -> float:
    """A bottleneck over its lower bound, as :attr:`Plan.bound_ratio` reads one (1.0 where the
    bound is 0: stages measured faster than the runtime's own cost per task leave no time)."""
    return bottleneck / bound if bound > 0 else 1.0
