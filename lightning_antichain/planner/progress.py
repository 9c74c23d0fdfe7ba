"""A progress line on stderr for work a person waits on (profiling, calibration)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``label: done/total unit, seconds``: redrawn in place on a terminal, every 10% otherwise (logs)."""

    def __init__(self, total: int, *, enabled: bool, label: str, unit: str) -> None:
        self.total, self.enabled, self.label, self.unit = total, enabled, label, unit
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self.last_tenth = -1

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        tenth = 10 * self.done // max(self.total, 1)
        if self.tty:
            sys.stderr.write(f"\r{self._line()}")
        elif tenth != self.last_tenth:
            sys.stderr.write(self._line() + "\n")
        self.last_tenth = tenth
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.started
        return f"{self.label}: {self.done}/{self.total} {self.unit}, {elapsed:.1f}s"
