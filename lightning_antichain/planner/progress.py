"""Progress of work a person waits on (capture, profiling, calibration), one phase at a time.

On a terminal each phase is a tqdm bar with what is being done, its rate and the time left; in a
log (stderr not a terminal) each phase leaves one line when it ends, so that what comes before
the first training step stays short.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from ..capture.status import status


class Progress:
    """One phase of ``total`` steps of ``unit``, named ``label``."""

    def __init__(self, total: int, *, enabled: bool, label: str, unit: str) -> None:
        self.total, self.enabled, self.label, self.unit = total, enabled, label, unit
        self.done = 0
        self.started = time.perf_counter()
        self._bar = tqdm(total=total, desc=label, unit=f" {unit}", leave=True, file=sys.stderr, dynamic_ncols=True,
                         mininterval=0.2) if enabled and sys.stderr.isatty() else None

    def step(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.done:
            status(f"{self.label}: {self.done}/{self.total} {self.unit} in {time.perf_counter() - self.started:.1f} s")
        self.enabled = False

