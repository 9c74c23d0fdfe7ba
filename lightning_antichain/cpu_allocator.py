"""Keeping freed CPU memory in the process, as PyTorch's caching allocator does on a GPU.

On Linux with glibc, freed memory goes back to the system: each thread that allocates gets its own
malloc arena, blocks over a threshold are mapped and unmapped one by one, and the top of the heap
is trimmed. Every training step then faults its activation memory in again: 12k-25k page faults
and 30-50 ms of system time per CNN step here, and stage times that change by 2x between runs of
one split as the thresholds move. :func:`keep_freed_memory` makes the process keep what it freed for
reuse; CPU stages call it unless told not to (``share_cpu_allocator=False``), in one process and as
processes, and planning profiles with it, so that the times planned are the times run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# from glibc's malloc.h: the setting, the environment variable that wins over it, and our value
_MALLOC_SETTINGS = (
    (-8, "MALLOC_ARENA_MAX", 1),  # M_ARENA_MAX: worker threads allocate from the main arena
    (-3, "MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD: blocks up to 32 MiB (glibc's most) reused
    (-1, "MALLOC_TRIM_THRESHOLD_", (1 << 31) - 1),  # M_TRIM_THRESHOLD: the heap is never trimmed
)
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (one arena, no mapping per block of up to
    32 MiB, no trimming), as ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=33554432
    MALLOC_TRIM_THRESHOLD_=2147483647`` would; ``True`` if it took effect. The process then holds on
    to its peak heap. A no-op off Linux or with another C library; a setting already made in the
    environment wins."""
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    if not sys.platform.startswith("linux"):
        return _kept
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _kept = all(bool(libc.mallopt(option, value)) for option, variable, value in _MALLOC_SETTINGS
                    if variable not in os.environ)
    except (OSError, AttributeError):
        _kept = False
    return _kept


def freed_memory_kept() -> bool:
    """Whether this process has malloc keep freed memory (:func:`keep_freed_memory` took effect)."""
    return bool(_kept)
