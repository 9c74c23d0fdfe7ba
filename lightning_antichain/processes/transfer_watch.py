"""What a rank was waiting for when a transfer between stages timed out.

torch's schedules wait for each transfer of a stage (its input forward, its output's gradient
back) just before the task that needs it, through one helper every schedule waits in
(``torch.distributed.pipelining.schedules._wait_batch_p2p``). Where the rank on the other end is
stuck, gone or slower than the process group's ``timeout``, the wait ends with gloo's or NCCL's
"timed out waiting for recv", which names neither the stage, the micro-batch nor the rank. While
a batch runs, :func:`transfers_watched` counts the tasks this rank has run, in the order its
schedule gives them, and turns a wait that timed out into a :class:`TransferTimeout` saying which
task it was about to run, what that task waits for, and from which stage and rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..plans.schedule import Task
from ..torch_private import batch_waits_through

#: the methods of torch's stages that run one task each
_TASKS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class TransferTimeout(RuntimeError):
    """A rank waited for a transfer of its pipeline longer than the process group's timeout."""


@contextmanager
def transfers_watched(stages: Sequence[Any], order: Sequence[Task], rank: int, rank_of: Callable[[int], int],
                      num_stages: int, timeout: timedelta | None) -> Iterator[None]:
    """Within, a wait of this ``rank`` (running torch's ``stages`` in ``order``) that times out
    raises a :class:`TransferTimeout` naming it (``rank_of``: the rank holding a stage)."""
    done = [0]

    def counted(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            done[0] += 1
            return result
        return run

    def watched(waited: Any) -> Any:
        def wait(works: Any) -> Any:
            try:
                return waited(works)
            except Exception as error:
                if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                    raise
                raise TransferTimeout(_said(order, done[0], rank, rank_of, num_stages, timeout)) from error
        return wait

    previous = [(stage, name, vars(stage).get(name)) for stage in stages for name in _TASKS]
    for stage in stages:
        for name in _TASKS:
            setattr(stage, name, counted(getattr(stage, name)))
    try:
        with batch_waits_through(watched):
            yield
    finally:
        for stage, name, method in previous:
            if method is None:
                vars(stage).pop(name, None)
            else:
                setattr(stage, name, method)


def _said(order: Sequence[Task], done: int, rank: int, rank_of: Callable[[int], int], num_stages: int,
          timeout: timedelta | None) -> str:
    waited = f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's timeout"
    after = f" (after its {_task(order[done - 1])})" if 0 < done <= len(order) else ""
    if done >= len(order):
        what = (f"after its last task{after}, for the transfers it sent to be taken by the ranks next to it in the "
                "pipeline")
    else:
        task = order[done]
        what = f"before its {_task(task)}{after}: {_needs(task, rank, rank_of, num_stages)}"
    return (f"rank {rank} waited {waited} (timeout=) for a transfer of its pipeline that did not come, {what}. That "
            "rank is stuck, gone, or slower than the timeout: its own output says which; where a step may take "
            "longer, give AntichainPipelineStrategy(timeout=...) more.")


def _task(task: Task) -> str:
    phase = {"forward": "forward", "backward": "backward", "backward_input": "backward (input gradients)",
             "backward_weight": "backward (weight gradients)"}[task.phase]
    return f"{phase} of micro-batch {task.micro_batch} on stage {task.stage}"


def _needs(task: Task, rank: int, rank_of: Callable[[int], int], num_stages: int) -> str:
    if task.phase == "forward" and task.stage > 0:
        return (f"it waits for stage {task.stage - 1}'s output for micro-batch {task.micro_batch}, from rank "
                f"{rank_of(task.stage - 1)}")
    if task.phase in ("backward", "backward_input") and task.stage < num_stages - 1:
        return (f"it waits for the gradient of stage {task.stage}'s output for micro-batch {task.micro_batch}, from "
                f"stage {task.stage + 1} on rank {rank_of(task.stage + 1)}")
    return "it waits for the transfers it sent before to be taken by the ranks next to it in the pipeline"
