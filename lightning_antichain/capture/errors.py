"""Why a model, or one frontend, could not be captured, and where in the user's code."""

from __future__ import annotations

import os
import traceback


class UntraceableModelError(RuntimeError):
    """No frontend of the capture chain could turn the model into a graph of operations.

    ``refused`` lists each frontend's reason, as ``"frontend: reason"``.
    """

    def __init__(self, message: str, refused: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.refused = tuple(refused)


class FrontendRefused(Exception):
    """One frontend cannot capture this model; the chain tries the next one.

    ``module_path`` is the dotted path of the submodule being captured when it failed, when known
    ("" for the model's own ``forward``); ``location`` is the user's file and line.
    """

    def __init__(self, reason: str, *, module_path: str | None = None, location: str = "",
                 data_dependent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.module_path = module_path
        self.location = location
        self.data_dependent = data_dependent


def user_frame(tb: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """``file:line (code)`` of the innermost frame outside torch and this package, or ""."""
    frames = [
        f
        for f in tb
        if f"{os.sep}torch{os.sep}" not in f.filename
        and "lightning_antichain" not in f.filename
        and f"{os.sep}contextlib.py" not in f.filename
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"


def logging_call(exc: BaseException) -> str:
    """``file:line (code)`` where ``forward`` called ``self.log``/``self.log_dict`` of a
    LightningModule on the way to ``exc`` (following its causes), or ""."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)
        for caller, frame in zip(frames, frames[1:]):
            if frame.name in ("log", "log_dict") and frame.filename.endswith(os.path.join("core", "module.py")) and (
                    "lightning" in frame.filename):
                return f"{caller.filename}:{caller.lineno} ({(caller.line or '').strip()})"
        current = current.__cause__ or current.__context__
    return ""


def location_of(exc: BaseException) -> str:
    """The user's file and line where ``exc`` was raised, or ""."""
    return user_frame(traceback.extract_tb(exc.__traceback__))


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1]) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
