"""Whether the machine still runs a calibrated plan as fast as when it was calibrated.

A calibration is measured once and cached, on a machine whose speed can change: other work
starts, a laptop throttles. A stale one silently mispredicts every step and steers
``chunks="auto"`` to a count chosen for another machine state. So the first training steps'
pipelined forward and backward are set beside the same span measured by the calibration, and the
user is told, once, with what to do, when they differ by more than the tolerance.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from ..plans.plan import Plan
from ..plans.schedule import Timed

TOLERANCE = 0.15
"""How far measured steps may stray from the calibration's before the user is told."""

FLOOR_S = 0.002
"""Differences under this are not reported: in steps of a few milliseconds, the Trainer's own
Python work around the pipeline differs from calibration's loop by about that much."""


def span_s(timed: Sequence[Sequence[Timed]]) -> float:
    """Seconds from the start of a step's forward pass to the end of its last task, less the pause
    between the forward pass and the backward pass (the caller's loss, not the pipeline's work)."""
    tasks = [t for stage in timed for t in stage]
    if not tasks:
        return 0.0
    forward_end = max((t.end for t in tasks if t.task.phase == "forward"), default=0.0)
    backward_start = min((t.start for t in tasks if t.task.phase == "backward"), default=forward_end)
    return max(t.end for t in tasks) - max(0.0, backward_start - forward_end)


class PredictionCheck:
    """Collects the pipelined span of a few training steps after the first (which warms up) and,
    once it has ``steps`` of them, compares their median with the span ``plan``'s calibration
    measured. ``plan_file``: where the plan was loaded from, if it was."""

    def __init__(self, plan: Plan, plan_file: str | Path | None = None, steps: int = 3,
                 tolerance: float = TOLERANCE, floor_s: float = FLOOR_S) -> None:
        self.plan = plan
        self.plan_file = plan_file
        self.steps = steps
        self.tolerance = tolerance
        self.floor_s = floor_s
        self.calibrated_s = float((plan.calibration or {}).get("pipelined_span_s") or 0.0)
        self.measured: list[float] = []
        self._skipped = False
        self.done = False

    def observe(self, timed: Sequence[Sequence[Timed]]) -> str | None:
        """Note one step's tasks; the warning to give, once, when the prediction has gone stale."""
        if self.done or self.calibrated_s <= 0 or not any(timed):
            return None
        if not self._skipped:
            self._skipped = True
            return None
        self.measured.append(span_s(timed))
        if len(self.measured) < self.steps:
            return None
        self.done = True
        return self.verdict(statistics.median(self.measured))

    def verdict(self, measured_s: float) -> str | None:
        """The warning for a median measured span of ``measured_s``, or ``None`` within the tolerance."""
        off = abs(measured_s - self.calibrated_s)
        if measured_s <= 0 or off <= self.tolerance * self.calibrated_s or off < self.floor_s:
            return None
        slower = "slower" if measured_s > self.calibrated_s else "faster"
        text = (
            f"lightning-antichain: the pipelined forward and backward take {1e3 * measured_s:.1f} ms, "
            f"{slower} than the {1e3 * self.calibrated_s:.1f} ms they took when the plan was calibrated "
            f"({measured_s / self.calibrated_s:.2f}x), so its predicted step no longer holds. "
        )
        read_from = (self.plan.calibration or {}).get("read_from")
        if self.plan_file is not None:
            text += (
                f"The plan was loaded from {self.plan_file} and calibrated where the machine ran at another speed; "
                "leave plan= out to plan and calibrate again here."
            )
        elif read_from:
            text += (
                f"Its calibration was read from {read_from}, measured while the machine ran at another "
                "speed; delete that file and the next run calibrates again."
            )
        else:
            text += (
                "It was calibrated moments ago, so the machine's speed is changing (other work on its cores?); "
                "predictions made now will not hold."
            )
        if self.plan.candidates:
            text += f' chunks="auto" chose {self.plan.chunks} from these predictions.'
        return text
