"""Draw a plan: the load of each stage, and the predicted GPipe timeline of one step.

Needs matplotlib (``pip install "lightning-antichain[plot]"``).
"""

from __future__ import annotations

import os
from dataclasses import astuple

from ..plans.plan import Plan


def plot_plan(plan: Plan, path: str | os.PathLike[str], title: str | None = None) -> None:
    """Write a PNG (or any format matplotlib knows from the suffix) of ``plan`` to ``path``."""
    try:
        from matplotlib.figure import Figure  # a figure of its own: no pyplot, no backend chosen for the process
    except ImportError as exc:
        raise ImportError('plotting needs matplotlib: pip install "lightning-antichain[plot]"') from exc

    stages = plan.stages
    fig = Figure(figsize=(13, 2.2 + (0.9 if stages[0].modules else 0.55) * len(stages)))
    loads, timeline = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})
    names = [f"stage {s.index} ({s.device})" + (f"\n{_short(s.modules[0])} ..\n{_short(s.modules[-1])}"
                                                   if s.modules else "") for s in stages]
    ms = 1e3
    y = range(len(stages))
    forward = [ms * s.forward_s for s in stages]
    backward = [ms * s.backward_s for s in stages]
    transfer = [ms * s.transfer_s for s in stages]
    loads.barh(y, forward, color="#4c72b0", label="forward")
    loads.barh(y, backward, left=forward, color="#dd8452", label="backward")
    loads.barh(y, transfer, left=[f + b for f, b in zip(forward, backward)], color="#8c8c8c", label="transfer")
    loads.axvline(ms * plan.lower_bound_s, color="black", linestyle="--", linewidth=1, label="lower bound")
    for i, s in enumerate(stages):
        loads.text(ms * s.time_s, i, f" {len(s.nodes)} ops, {s.memory_bytes / 1e6:.0f} MB", va="center", fontsize=8)
    loads.set_yticks(list(y), names)
    loads.invert_yaxis()
    loads.set_xlabel("ms per micro-batch")
    loads.set_title(f"stage loads (bottleneck x{plan.bound_ratio:.3f} the bound)")
    loads.set_xlim(0, 1.6 * ms * max(max(s.time_s for s in stages), plan.lower_bound_s))
    loads.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.02 * len(stages)), ncol=4, fontsize=8)

    for timed in plan.timeline():
        (phase, stage, micro), start, end = astuple(timed.task), timed.start, timed.end
        color = "#4c72b0" if phase == "forward" else "#dd8452"
        timeline.barh(stage, ms * (end - start), left=ms * start, color=color, edgecolor="white", linewidth=0.6)
        if ms * (end - start) > 0.04 * ms * plan.predicted_step_s:
            middle = ms * (start + end) / 2
            timeline.text(middle, stage, str(micro), ha="center", va="center", color="white", fontsize=7)
    timeline.set_yticks(list(y), names)
    timeline.invert_yaxis()
    timeline.set_xlabel("ms")
    step_ms = ms * plan.predicted_step_s
    timeline.set_title(f"predicted {plan.schedule} step: {plan.chunks} micro-batches, {step_ms:.1f} ms")
    timeline.text(
        0.0,
        -0.25 - 0.02 * len(stages),
        "blue: forward, orange: backward, numbers: micro-batches",
        transform=timeline.transAxes,
        fontsize=8,
    )
    fig.suptitle(title or f"{plan.model or 'model'}: {plan.num_stages} stages, method {plan.method}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _short(module: str, keep: int = 3) -> str:
    """The last ``keep`` parts of a dotted module path, for a label."""
    parts = module.split(".")
    return module if len(parts) <= keep else "…" + ".".join(parts[-keep:])

