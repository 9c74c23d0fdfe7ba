"""One line of progress on stderr, for the layers above too (capture is the lowest that reports)."""

from __future__ import annotations

import sys


def status(line: str, *, final: bool = True) -> None:
    """Write ``line`` to stderr. ``final`` lines stay; others show on a terminal only, each
    replacing the one before, so that a log keeps one line per phase."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{line}" + ("\n" if final else ""))
    elif final:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
