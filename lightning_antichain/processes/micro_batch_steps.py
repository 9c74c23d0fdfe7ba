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
from torch import nn

from ..batches import microbatch
from ..batches.batch_dims import BatchDim, call_dims
from ..torch_private import pytree
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


def refuse_whole_batch_arguments(target: nn.Module, describe: str, hook: str, call: tuple[tuple, dict], samples: int,
                                 batch_dim: BatchDim) -> None:
    """Refuse a call of the module, made by the step on a micro-batch of ``samples`` samples, with a
    tensor that holds another count of samples on its batch dim: a value the step made from the
    whole batch, or kept from the step before (an RNN's hidden state carried from batch to batch),
    which the micro-batch's call cannot split with its samples."""
    args, kwargs, dims = call_dims(target, *call, batch_dim)
    batched = {id(t): (t, d) for t, d in microbatch.batched_tensors((args, kwargs), dims)}
    wrong = [(_argument(path), tuple(v.shape), batched[id(v)][1]) for path, v in
             pytree.tree_flatten_with_path((args, kwargs))[0]
             if id(v) in batched and v.shape[batched[id(v)][1]] != samples]
    if not wrong:
        return
    where, shape, dim = wrong[0]
    raise ValueError(
        f"{hook} calls {describe} on a micro-batch of {samples} samples with {where} of shape {shape}, "
        f"whose batch dim ({dim}) holds {shape[dim]}: with one process per stage (schedule=...) the step runs once "
        "per micro-batch, and a value it makes from the whole batch or keeps from the step before (a hidden state "
        "carried from batch to batch) is not split with the samples. Make it from the micro-batch the step is given, "
        "pass it in the batch the data loader gives, or leave out schedule= to run the step once on the whole batch. "
        "If its samples are on another dim, say so with batch_dim=")


def _argument(path: tuple) -> str:
    """A leaf's path in a call's ``(args, kwargs)`` as the call names it: ``hidden[0]``, ``args[1]``."""
    rest = pytree.keystr(path[2:])
    if path[0].idx == 1:
        return f"{path[1].key}{rest}"
    return f"args[{path[1].idx}]{rest}"
