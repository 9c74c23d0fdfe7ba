"""The user's step hook run on one micro-batch, with the pipelined module answering inside it.

With one process per stage, the module's forward is not one call but two ends of a pipeline. On
the rank of the first stage the step runs up to its call of the module, only to take the call's
arguments (:meth:`MicroBatchSteps.call_of`; what it logs is dropped). On the rank of the last
stage it runs whole, with the module answering that micro-batch's output
(:meth:`MicroBatchSteps.result_of`). The step therefore runs unchanged, once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule

from .step_logs import StepLogs, discarded


class _CallTaken(Exception):  # noqa: N818 - a signal, not an error
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("the pipelined module's arguments were taken")
        self.args, self.kwargs = args, kwargs


class MicroBatchSteps:
    """``module``'s steps, one micro-batch at a time; :meth:`forward` stands for the pipelined
    module's forward (``describe`` names that module in errors)."""

    def __init__(self, module: LightningModule, describe: str) -> None:
        self.module = module
        self.describe = describe
        self._output: Any = None
        self._mode: str | None = None
        #: the arguments of the module's call the module answered last (:meth:`result_of`)
        self.given_call: tuple[tuple, dict] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "take":
            raise _CallTaken(args, kwargs)
        if self._mode == "give":
            self._mode = "given"
            self.given_call = args, kwargs
            return self._output
        if self._mode == "given":
            raise RuntimeError(f"the step called {self.describe} twice for one micro-batch; with one process per stage "
                               "it runs once per step. Reuse its output.")
        raise RuntimeError(
            f"{self.describe} was called outside training_step, validation_step, test_step and predict_step. With one "
            "process per stage (schedule=...) its stages live in other processes; call it inside the steps."
        )

    def call_of(self, hook: str, batch: Any, rest: tuple) -> tuple[tuple, dict] | None:
        """The arguments the step ``hook`` calls the module with, for ``batch``; ``None`` where it
        returns ``None`` before calling it: the step skips the batch, as Lightning lets it."""
        self._mode = "take"
        try:
            with discarded(self.module):
                returned = getattr(self.module, hook)(batch, *rest)
        except _CallTaken as taken:
            return taken.args, taken.kwargs
        finally:
            self._mode = None
        if returned is None:
            return None
        raise RuntimeError(f"{hook} never called {self.describe}, so nothing was pipelined. Call it in {hook} (e.g. "
                           "self(x)), or set AntichainPipelineStrategy(module='name') to the submodule it calls.")

    def result_of(self, hook: str, batch: Any, rest: tuple, output: Any, logs: StepLogs,
                  weight: float | Callable[[Any], float]) -> Any:
        """What the step ``hook`` returns for ``batch`` when the module answers ``output``; its
        ``self.log`` calls go to ``logs``, each value with ``weight`` (:meth:`StepLogs.recording`)."""
        self._output, self._mode = output, "give"
        try:
            with logs.recording(self.module, weight):
                result = getattr(self.module, hook)(batch, *rest)
            if self._mode != "given":
                raise RuntimeError(f"{hook} did not call {self.describe} on this micro-batch, though it did on the "
                                   "first rank; a step must call it on every batch")
            return result
        finally:
            self._output, self._mode = None, None
